"""A lower bound on the makespan of any schedule of a sampled workload (documented in docs/scheduling.md).

Two bounds, the larger wins:
- **Chain** (critical path). Let U_s be when update s ends (version s + 1 is published). Batch s
  cannot launch before U_{s-eta-1} (0 for s <= eta), a group's training work is queued no earlier
  than launch + its longest execution, training of batch s needs version s (so starts after
  U_{s-1}) and runs on at most C cells, less the one hosting the batch's longest execution (length
  L_s) while it runs: after x that execution still runs for at least h = A_s + L_s - x, and it ends
  before the batch's training does (its own group's work comes after it). For every group end
  offset t of batch s, with x = max(U_{s-1}, A_s + t) and A_s = U_{s-eta-1}:
      U_s >= x + (W_s(released at offset >= t) + max(0, h)) / C + optimizer_step.
  Without the h term, for eta = 0, this is the reference's per-step bound "max over t of
  (t + training work released at or after t / C)", chained over steps.
- **Work**. Every cell does one thing at a time: (rollout cell-seconds + training cell-seconds) / C,
  plus the last optimizer step. Rollout cell-seconds = sum of duration x demand / cell capacity.
  On-policy (eta = 0) the batches roll out one after another, and while a batch's longest
  execution runs some cell is in the rollout role, so each batch needs at least
  max(its rollout cell-seconds, its longest execution) of rollout-role time.
Switch, migration, weight-sync and gradient-sync costs are left out (a fixed split needs no
switch, a single trainer no gradient sync), so the bound holds for every policy.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from gyre_ray.sim.workload import SampledWorkload


@dataclass(frozen=True)
class LowerBound:
    """The bound (seconds) and its two parts; `update_s[s]` is the chain's earliest end of update s."""

    total_s: float
    chain_s: float
    work_s: float
    update_s: tuple[float, ...]


def _train_time(work: np.ndarray, held_s: np.ndarray, n_cells: int) -> np.ndarray:
    """Least time to train `work` cell-seconds on C cells when one cell is busy rolling out `held_s` of it.

    The batch's longest execution (length L, launched at A or later) still runs for at least
    `held_s` = A + L - x after the training starts at x, on a cell in the rollout role, and it ends
    before the training does (its group's work comes after it). So C x time >= work + held_s.
    """
    return (work + np.maximum(held_s, 0.0)) / n_cells


def lower_bound(
    wl: SampledWorkload, n_cells: int, staleness: int, optimizer_step_s: float = 0.0
) -> LowerBound:
    """Lower bound on the makespan of running `wl` on `n_cells` cells with staleness bound `staleness`."""
    if n_cells < 1 or staleness < 0:
        raise ValueError(f"need n_cells >= 1 and staleness >= 0, got {n_cells}, {staleness}")
    work = wl.train_cell_s(n_cells)
    n_groups = wl.n_groups
    group_end = np.zeros(n_groups)
    np.maximum.at(group_end, wl.group, wl.duration_s)
    group_work = np.bincount(wl.group, weights=work, minlength=n_groups)
    group_batch = np.zeros(n_groups, dtype=np.int64)
    group_batch[wl.group] = wl.batch

    updates: list[float] = []
    for s in range(wl.steps):
        mask = group_batch == s
        offsets, works = group_end[mask], group_work[mask]
        order = np.argsort(offsets)
        offsets, works = offsets[order], works[order]
        after = np.cumsum(works[::-1])[::-1]  # work released at offset >= offsets[i]
        launch = updates[s - staleness - 1] if s - staleness - 1 >= 0 else 0.0
        previous = updates[s - 1] if s >= 1 else 0.0
        if offsets.size:
            start = np.maximum(previous, launch + offsets)
            finish = float(np.max(start + _train_time(after, launch + offsets[-1] - start, n_cells)))
        else:
            finish = previous
        updates.append(finish + optimizer_step_s)
    chain = updates[-1] if updates else 0.0
    per_batch = np.bincount(wl.batch, weights=wl.duration_s * wl.demand, minlength=wl.steps)
    per_batch /= wl.capacity_per_cell(n_cells)
    if staleness == 0:  # batches do not overlap: the longest execution keeps one cell rolling out
        longest = np.zeros(wl.steps)
        np.maximum.at(longest, wl.batch, wl.duration_s)
        per_batch = np.maximum(per_batch, longest)
    work_bound = (float(per_batch.sum()) + float(np.sum(work))) / n_cells + optimizer_step_s
    return LowerBound(max(chain, work_bound), chain, work_bound, tuple(updates))
