"""`put_recent`: the trim rule the in-memory caches share (newest `limit` entries, oldest first)."""

from __future__ import annotations

from collections import OrderedDict

from gyre_ray.recent import put_recent


def test_a_table_keeps_its_newest_entries_and_a_rewrite_makes_one_newest() -> None:
    table: OrderedDict[str, int] = OrderedDict()
    for i, key in enumerate("abc"):
        put_recent(table, key, i, limit=3)
    put_recent(table, "a", 10, limit=3)  # rewritten: now the newest
    put_recent(table, "d", 3, limit=3)  # the oldest, b, goes
    assert list(table.items()) == [("c", 2), ("a", 10), ("d", 3)]
    put_recent(table, "e", 4, limit=1)
    assert list(table.items()) == [("e", 4)]
