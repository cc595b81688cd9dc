"""A proxy replica's cache of recorded outputs (splice key -> call id and output token ids), bounded.

The store holds every execution's splice index; a replica keeps what its calls recently produced or
looked up, so that a re-sent assistant turn is spliced without asking the store. `finish` clears an
execution's entries only on the replica that served it, and an execution's calls are spread over
every replica, so the cache is bounded on its own: at most `per_execution` entries an execution, and
at most `max_tokens` token ids in all, the least recently used execution's entries dropped first
(a miss only costs a look-up in the store). Without the second bound, an hours-long run with many
replicas grew each replica's memory by every execution it ever served.
"""

from __future__ import annotations

from collections import OrderedDict

Entry = tuple[str, list[int]]  # (call id, output token ids)


class SpliceCache:
    """Recorded outputs by execution and splice key, least recently used dropped first."""

    def __init__(self, per_execution: int = 1024, max_tokens: int = 4_000_000) -> None:
        if per_execution < 1 or max_tokens < 1:
            raise ValueError(f"per_execution and max_tokens must be >= 1, got {per_execution}, {max_tokens}")
        self.per_execution = per_execution
        self.max_tokens = max_tokens
        self._entries: OrderedDict[str, OrderedDict[str, Entry]] = OrderedDict()
        self._tokens: dict[str, int] = {}  # token ids held per execution
        self.tokens = 0  # token ids held in all

    def __len__(self) -> int:
        """Executions with entries."""
        return len(self._entries)

    def get(self, execution_id: str, key: str) -> Entry | None:
        """The entry of `key`, or None (the execution becomes the most recently used)."""
        entries = self._entries.get(execution_id)
        if entries is None:
            return None
        self._entries.move_to_end(execution_id)
        return entries.get(key)

    def remember(self, execution_id: str, key: str, call_id: str, ids: list[int]) -> None:
        """Keep `key` -> (`call_id`, `ids`), dropping old entries past either bound."""
        entries = self._entries.setdefault(execution_id, OrderedDict())
        self._entries.move_to_end(execution_id)
        old = entries.pop(key, None)
        self._count(execution_id, len(ids) - (len(old[1]) if old else 0))
        entries[key] = (call_id, ids)
        while len(entries) > self.per_execution:
            self._count(execution_id, -len(entries.popitem(last=False)[1][1]))
        while self.tokens > self.max_tokens and len(self._entries) > 1:  # this execution is the newest
            self.forget(next(iter(self._entries)))

    def forget(self, execution_id: str) -> None:
        """Drop an execution's entries (it finished, or it was used least recently)."""
        self._entries.pop(execution_id, None)
        self.tokens -= self._tokens.pop(execution_id, 0)

    def _count(self, execution_id: str, delta: int) -> None:
        self._tokens[execution_id] = self._tokens.get(execution_id, 0) + delta
        self.tokens += delta
