import pytest
from romankit import from_roman, to_roman


def test_small_numbers():
    assert [to_roman(n) for n in (1, 4, 9, 14)] == ["I", "IV", "IX", "XIV"]


def test_large_number():
    assert to_roman(1994) == "MCMXCIV"


def test_round_trip():
    assert all(from_roman(to_roman(n)) == n for n in range(1, 400))


def test_out_of_range():
    with pytest.raises(ValueError):
        to_roman(0)
