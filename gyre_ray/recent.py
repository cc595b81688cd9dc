"""Bounded most-recently-used tables: the one trim rule of every in-memory cache in the run.

Caches that only speed things up (a proxy replica's key look-ups, a router's affinities, a cell's
session prefixes, a store's splice index, an executor's remembered outcomes) keep their newest
`limit` entries in an `OrderedDict`, oldest first.
"""

from __future__ import annotations

from collections import OrderedDict
from typing import TypeVar

K = TypeVar("K")
V = TypeVar("V")


def put_recent(table: OrderedDict[K, V], key: K, value: V, limit: int) -> None:
    """`table[key] = value` as the newest entry; the oldest go while more than `limit` remain."""
    table[key] = value
    table.move_to_end(key)
    while len(table) > limit:
        table.popitem(last=False)
