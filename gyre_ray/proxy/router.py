"""Which rollout cell serves a call: session affinity first, least-loaded otherwise. Pure Python.

An execution's calls stay on the cell that served its first call (its prefix cache is there) for as
long as that cell is routable; a drained cell is skipped, and the execution is re-pinned to the
least-loaded routable cell. Load is the number of calls this proxy replica has in flight per cell.
Drain state follows the cells' own flags (`observed`, fed by the replica's poll); what this replica
did or saw itself since a poll began wins over that poll's reading.
"""

from __future__ import annotations

from collections import OrderedDict

from gyre_ray.recent import put_recent


class Router:
    """Routing state of one proxy replica."""

    def __init__(self, cell_ids: list[str], max_affinities: int = 100_000) -> None:
        self.cell_ids: list[str] = list(cell_ids)
        self.drained: set[str] = set()
        self.changes: dict[str, int] = {}  # local drain / undrain / refusal count per cell
        self.load: dict[str, int] = {cell: 0 for cell in cell_ids}
        self.affinity: OrderedDict[str, str] = OrderedDict()
        self.max_affinities = max_affinities

    def routable(self, exclude: set[str] | frozenset[str] = frozenset()) -> list[str]:
        """Cells that may take a call now."""
        return [c for c in self.cell_ids if c not in self.drained and c not in exclude]

    def choose(
        self, execution_id: str | None, exclude: set[str] | frozenset[str] = frozenset()
    ) -> str | None:
        """The cell for the next call of `execution_id` (None when no cell is routable)."""
        candidates = self.routable(exclude)
        if not candidates:
            return None
        if execution_id is not None:
            pinned = self.affinity.get(execution_id)
            if pinned in candidates:
                self.affinity.move_to_end(execution_id)
                return pinned
        pins = {c: 0 for c in candidates}
        for cell in self.affinity.values():
            if cell in pins:
                pins[cell] += 1
        chosen = min(candidates, key=lambda c: (self.load.get(c, 0), pins[c], self.cell_ids.index(c)))
        if execution_id is not None:
            put_recent(self.affinity, execution_id, chosen, self.max_affinities)
        return chosen

    def started(self, cell_id: str) -> None:
        self.load[cell_id] = self.load.get(cell_id, 0) + 1

    def finished(self, cell_id: str) -> None:
        self.load[cell_id] = max(0, self.load.get(cell_id, 0) - 1)

    def drain(self, cell_id: str) -> None:
        self._check(cell_id)
        self.drained.add(cell_id)
        self.changes[cell_id] = self.changes.get(cell_id, 0) + 1

    def undrain(self, cell_id: str) -> None:
        self._check(cell_id)
        self.drained.discard(cell_id)
        self.changes[cell_id] = self.changes.get(cell_id, 0) + 1

    def observed(self, cell_id: str, draining: bool, changes_before: int) -> None:
        """The cell's own flag, read by a poll that began when `changes[cell_id]` was `changes_before`.

        A drain, undrain or refusal seen here after the poll began is newer: the poll's reading is dropped.
        """
        if self.changes.get(cell_id, 0) != changes_before:
            return
        if draining:
            self.drained.add(cell_id)
        else:
            self.drained.discard(cell_id)

    def forget(self, execution_id: str) -> None:
        """Drop an execution's affinity (it finished)."""
        self.affinity.pop(execution_id, None)

    def _check(self, cell_id: str) -> None:
        if cell_id not in self.cell_ids:
            raise KeyError(f"unknown cell {cell_id!r}; cells: {', '.join(self.cell_ids)}")
