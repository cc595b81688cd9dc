from slugkit import slugify


def test_words_and_punctuation():
    assert slugify("Hello, World!") == "hello-world"


def test_spaces_collapse_and_ends_strip():
    assert slugify("  A  b ") == "a-b"


def test_empty():
    assert slugify("") == ""


def test_digits_kept_and_symbols_joined():
    assert slugify("Top 10 -- tips & tricks") == "top-10-tips-tricks"
