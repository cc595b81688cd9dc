from rlekit import decode, encode


def test_runs():
    assert encode("aaab") == [("a", 3), ("b", 1)]


def test_empty():
    assert encode("") == []


def test_decode():
    assert decode([("x", 2), ("y", 1)]) == "xxy"


def test_round_trip():
    text = "zzzzabbbcddddde"
    assert decode(encode(text)) == text
