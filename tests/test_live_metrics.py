"""The scheduler's live metrics count every token a cell's engine decoded, from its first poll on."""

from __future__ import annotations

from typing import Any

from gyre_ray.runtime.live_metrics import LiveMetrics


class RecordingMetrics:
    """Stands in for RuntimeMetrics: keeps the generated-token increments per cell."""

    def __init__(self) -> None:
        self.generated: dict[str, int] = {}

    def tokens(self, cell: str, trained: int = 0, generated: int = 0) -> None:
        self.generated[cell] = self.generated.get(cell, 0) + generated


def _status(cell: str, decoded: int) -> dict[str, Any]:
    return {"cell_id": cell, "engine": {"decode_tokens": decoded}}


def test_tokens_decoded_before_the_first_poll_are_counted_and_a_restart_counts_from_zero() -> None:
    live = LiveMetrics()
    live.metrics = RecordingMetrics()
    live.count_generated([_status("cell-0", 40), _status("cell-1", 0)])  # decoded before the first poll
    live.count_generated([_status("cell-0", 100), _status("cell-1", 7)])
    live.count_generated([_status("cell-0", 100), _status("cell-1", 3)])  # cell-1 restarted: a new engine
    assert live.metrics.generated == {"cell-0": 100, "cell-1": 10}


def test_a_cell_being_restarted_is_not_asked(monkeypatch) -> None:
    """Its engine is built with its event loop held: asking it held the scheduler's loop 5 s a poll."""
    from types import SimpleNamespace

    import ray

    asked: list[int] = []

    def cell(index: int) -> SimpleNamespace:
        def remote() -> dict[str, Any]:
            asked.append(index)
            return {"cell_id": f"cell-{index}", "engine": {"decode_tokens": 5, "waiting": 0}}

        return SimpleNamespace(status=SimpleNamespace(remote=remote))

    monkeypatch.setattr(ray, "get", lambda refs, timeout=None: list(refs))
    from gyre_ray.scheduling.runtime import CellPhase, CellView

    # cell 3 is lost for good (dead, not restarted): asking it would fail every poll
    views = [
        CellView(f"cell-{i}", i, phase=CellPhase.LOST if i == 3 else CellPhase.ROLLOUT) for i in range(4)
    ]
    sched = SimpleNamespace(actors=[cell(i) for i in range(4)], _restarting=lambda i: i == 1, views=views)
    live = LiveMetrics()
    live.metrics = RecordingMetrics()
    live.poll_engines(sched)
    assert asked == [0, 2] and sorted(live.waiting_calls) == [0, 2]
    assert live.metrics.generated == {"cell-0": 5, "cell-2": 5}
