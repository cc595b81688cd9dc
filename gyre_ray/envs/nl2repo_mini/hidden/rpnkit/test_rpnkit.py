import pytest
from rpnkit import evaluate


def test_sum():
    assert evaluate("3 4 +") == 7.0


def test_nested():
    assert evaluate("3 4 + 2 *") == 14.0


def test_division_and_subtraction():
    assert evaluate("10 4 - 3 /") == 2.0


def test_malformed():
    with pytest.raises(ValueError):
        evaluate("1 +")
