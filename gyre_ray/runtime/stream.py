"""The streaming micro-batch queue of one batch (one update): plain bookkeeping, no Ray.

Micro-batches arrive (as Ray object refs, or anything) as soon as a group of executions has ended
and been processed; whichever training cell is free claims the next one; a claim is either trained
or handed back (the cell left); a trained one whose gradients died with their cell is trained again. When the queue is sealed (no more groups to come) and every
micro-batch is trained, the step is complete: the gradients of every cell that trained are summed
on the core and scaled once by `scale` = 1 / (distinct executions in the step: those in its
micro-batches and those of advantage 0 left out of training, `count`), exactly as
`gyre_ray.algo.gspo.step_scale` does for the single-trainer loop.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Iterable
from dataclasses import dataclass
from typing import Any


@dataclass
class QueuedMicroBatch:
    """One micro-batch of the step: where its data lives and who claimed / trained it."""

    index: int
    ref: Any
    execution_ids: tuple[str, ...]
    claimed_by: str | None = None
    trained_by: str | None = None


class MicroBatchStream:
    """FIFO of a step's micro-batches with claims; knows when the step's data is all trained."""

    def __init__(self) -> None:
        self.items: list[QueuedMicroBatch] = []
        self.counted: set[str] = set()  # executions in the step's mean that no micro-batch holds
        self._unclaimed: deque[int] = deque()
        self.sealed = False
        self.released = False

    def put(self, ref: Any, execution_ids: Iterable[str]) -> int:
        """Queue a micro-batch; returns its index."""
        if self.sealed:
            raise RuntimeError("the step's micro-batch queue is sealed: no more micro-batches")
        item = QueuedMicroBatch(len(self.items), ref, tuple(execution_ids))
        self.items.append(item)
        self._unclaimed.append(item.index)
        return item.index

    def count(self, execution_ids: Iterable[str]) -> None:
        """Executions the step's mean counts although no micro-batch holds them (advantage 0: their
        gradient is zero, so they are not trained)."""
        if self.sealed:
            raise RuntimeError("the step's micro-batch queue is sealed: no more executions")
        self.counted.update(execution_ids)

    def seal(self) -> None:
        """No more micro-batches will come for this step."""
        self.sealed = True

    def claim(self, cell_id: str) -> QueuedMicroBatch | None:
        """The oldest unclaimed micro-batch, now claimed by `cell_id` (None when none is queued)."""
        if not self._unclaimed:
            return None
        item = self.items[self._unclaimed.popleft()]
        item.claimed_by = cell_id
        return item

    def trained(self, index: int, cell_id: str) -> None:
        """`cell_id` has added the gradients of micro-batch `index` to its replica."""
        item = self.items[index]
        if item.claimed_by != cell_id or item.trained_by is not None:
            raise RuntimeError(
                f"micro-batch {index} is claimed by {item.claimed_by!r} (trained by {item.trained_by!r}), "
                f"not trainable by {cell_id!r}"
            )
        item.trained_by = cell_id

    def give_back(self, index: int) -> None:
        """A claim that was not trained (the cell failed or left): the micro-batch goes first in line."""
        item = self.items[index]
        if item.trained_by is not None:
            raise RuntimeError(f"micro-batch {index} is already trained by {item.trained_by!r}")
        item.claimed_by = None
        self._unclaimed.appendleft(index)

    def untrain(self, index: int) -> None:
        """A trained micro-batch whose gradients were lost (its cell died before they reached the
        core): it goes first in line to be trained again."""
        item = self.items[index]
        if item.trained_by is None:
            raise RuntimeError(f"micro-batch {index} is not trained; nothing to undo")
        item.trained_by = item.claimed_by = None
        self._unclaimed.appendleft(index)

    @property
    def queued(self) -> int:
        """Micro-batches waiting for a trainer."""
        return len(self._unclaimed)

    @property
    def in_training(self) -> int:
        return sum(1 for i in self.items if i.claimed_by is not None and i.trained_by is None)

    @property
    def trained_count(self) -> int:
        return sum(1 for i in self.items if i.trained_by is not None)

    @property
    def complete(self) -> bool:
        """Sealed and every micro-batch trained (also true for a sealed, empty step)."""
        return self.sealed and self.trained_count == len(self.items)

    def executions(self) -> set[str]:
        """The executions the step's mean counts: its micro-batches' and the `count`ed ones."""
        return {e for item in self.items for e in item.execution_ids} | self.counted

    def scale(self) -> float:
        """1 / distinct `executions()` (the optimizer step's `scale`)."""
        executions = self.executions()
        if not executions:
            raise ValueError("no executions in this step's micro-batches; nothing to scale")
        return 1.0 / len(executions)

    def release(self) -> None:
        """Drop the micro-batches' data (their object refs, which keep them in Ray's object store):
        the step is published and long past; its bookkeeping stays."""
        for item in self.items:
            item.ref = None
        self.released = True

    def trained_by_cell(self) -> dict[str, int]:
        """Micro-batches trained per cell."""
        counts: dict[str, int] = {}
        for item in self.items:
            if item.trained_by is not None:
                counts[item.trained_by] = counts.get(item.trained_by, 0) + 1
        return counts
