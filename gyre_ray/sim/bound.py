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
  A batch with no training work at all (every execution of advantage 0) takes no optimizer step, as
  in the runtime (`step_costs`). Without the h term, for eta = 0, this is the reference's
  per-step bound "max over t of (t + training work released at or after t / C)", chained over steps.
- **Work**. Every cell does one thing at a time: (rollout occupancy R + training cell-seconds W +
  cell-seconds in which no work can be done) / C, plus the last optimizer step. R = sum of
  duration x demand / cell capacity. The non-work part is the larger of two lower bounds:
  the rollout role beyond R (some cell rolls out while any execution runs; batches b and
  b + eta + 1 never overlap: `rollout_role_lower_bound`; on-policy that is max(R_b, L_b) per
  batch) and the start-up (before update a, only batches <= a + eta roll out and <= a train:
  `start_idle_lower_bound`).
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
    train_per_batch = wl.train_cell_s_per_batch(n_cells)
    step_s = step_costs(train_per_batch, optimizer_step_s)

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
        updates.append(finish + float(step_s[s]))
    chain = updates[-1] if updates else 0.0
    rollout = wl.duration_s * wl.demand
    per_batch = np.bincount(wl.batch, weights=rollout, minlength=wl.steps) / wl.capacity_per_cell(n_cells)
    longest = np.zeros(wl.steps)
    np.maximum.at(longest, wl.batch, wl.duration_s)
    rollout_role_s = rollout_role_lower_bound(per_batch, longest, staleness)
    idle_s = start_idle_lower_bound(np.asarray(updates), per_batch, train_per_batch, n_cells, staleness)
    total_work = float(np.sum(per_batch)) + float(np.sum(work))
    not_working = max(rollout_role_s - float(np.sum(per_batch)), idle_s)
    work_bound = (total_work + not_working) / n_cells + (float(step_s[-1]) if wl.steps else 0.0)
    return LowerBound(max(chain, work_bound), chain, work_bound, tuple(updates))


def step_costs(train_per_batch: np.ndarray, optimizer_step_s: float) -> np.ndarray:
    """Per batch, the optimizer step its update takes: none for a batch with no training work (a
    replayed trace whose every execution had advantage 0: the runtime skips the step and publishes
    nothing, and so does the simulator), `optimizer_step_s` otherwise."""
    return np.where(train_per_batch > 0, optimizer_step_s, 0.0)


def rollout_role_lower_bound(rollout_cell_s: np.ndarray, longest_s: np.ndarray, staleness: int) -> float:
    """Least cell-seconds any schedule spends with cells in the rollout role (docs/scheduling.md).

    `rollout_cell_s[b]`: batch b's occupancy (duration x demand / cell capacity, summed);
    `longest_s[b]`: its longest execution. Batches b and b + eta + 1 never roll out at the same
    time (the later one launches after update b, which waits for every execution of b), so for
    each residue class j of batches mod (eta + 1) their windows are disjoint, and while any of
    them runs at least one cell is in the rollout role. With G_j = sum over the class of
    max(0, L_b - R_b) and R_not_j the occupancy of the other classes (which can hide inside those
    windows at best), the rollout role takes at least R + max_j max(0, G_j - R_not_j).
    For eta = 0 that is sum_b max(R_b, L_b).
    """
    total = float(np.sum(rollout_cell_s))
    classes = staleness + 1
    extra = 0.0
    for j in range(min(classes, rollout_cell_s.size)):
        gap = float(np.sum(np.maximum(longest_s[j::classes] - rollout_cell_s[j::classes], 0.0)))
        others = total - float(np.sum(rollout_cell_s[j::classes]))
        extra = max(extra, gap - others)
    return total + extra


def start_idle_lower_bound(
    update_lb_s: np.ndarray,
    rollout_cell_s: np.ndarray,
    train_cell_s: np.ndarray,
    n_cells: int,
    staleness: int,
) -> float:
    """Cell-seconds in which no cell can work before some update (docs/scheduling.md, "Start-up").

    Before update a ends (at U_a >= the chain's `update_lb_s[a]`), cells can only roll out batches
    <= a + eta and train batches <= a; so at least C x U_a minus that work is spent not working.
    """
    best = 0.0
    for a in range(update_lb_s.size - 1):  # the last update's own idle time is the optimizer step
        top = min(a + staleness, rollout_cell_s.size - 1)
        available = float(np.sum(rollout_cell_s[: top + 1]) + np.sum(train_cell_s[: a + 1]))
        best = max(best, n_cells * float(update_lb_s[a]) - available)
    return best
