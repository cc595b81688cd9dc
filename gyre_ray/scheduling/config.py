"""Config section `scheduler`: which scheduling policy drives the cells, and its knobs.

Shared by the Ray scheduler actor and the simulator (`gyre-ray simulate` reads the knobs from here).
"""

from __future__ import annotations

from typing import Literal

from pydantic import Field, model_validator

from gyre_ray.configbase import Section
from gyre_ray.scheduling.launch_order import DurationPrior
from gyre_ray.sim.workload import DurationModel


class SchedulerSection(Section):
    """Scheduling policy and its knobs (shared by the simulator and the Ray scheduler)."""

    policy: Literal["elastic", "colocate", "async"] = Field("elastic", description="Scheduling policy.")
    staleness: int = Field(1, ge=0, description="Max policy-version lag of trained tokens (eta).")
    elastic_repay_factor: float = Field(
        1.0,
        ge=0,
        description="elastic: switch a cell to training only if queued work per trainer >= this x "
        "(switch-in + switch-out time).",
    )
    elastic_prefetch: Literal["eager", "spare", "paced", "trickle"] = Field(
        "eager",
        description="elastic, eta >= 1: 'eager' pulls trainers back as soon as a later batch may launch; "
        "'spare' launches later batches only into room left on rollout cells and idle trainers; "
        "'paced' is eager but keeps enough trainers to clear the queued work by elastic_pace_s after "
        "the trainable batch's latest launch; 'trickle' is spare but fills only the cells the trainable "
        "batch's own executions need.",
    )
    elastic_pace_s: float = Field(
        5400.0,
        gt=0,
        description="elastic, prefetch 'paced': seconds after the trainable batch's latest launch by which "
        "its queued training should be done (the simulator tries 1 and 1.5 x the longest execution).",
    )
    elastic_launch_order: Literal["fifo", "sibling"] = Field(
        "fifo",
        description="elastic: which pending executions of a batch launch first; 'fifo' in id order, "
        "'sibling' by what each task's launched executions showed so far (needs "
        "elastic_duration_prior; docs/scheduling.md, 'launch order').",
    )
    elastic_duration_prior: DurationModel | Literal["auto"] | None = Field(
        None,
        description="elastic, launch order 'sibling': the tasks' duration model, as a workload's "
        "`duration` gives it (mu_log_hours, sigma_log_hours > 0, 0 < rho < 1, timeout_hours; "
        "runaway_fraction is not used; `gyre-ray simulate --trace RUN_DIR` fits one to a run), or "
        "'auto': fitted to the run's own ended executions at every step's end (first in first out "
        "until a fit succeeds).",
    )
    async_train_cells: int = Field(
        0,
        ge=0,
        description="async: cells that train for the whole run (the rest roll out; nothing ever switches); "
        "0 = half the cells, rounded down, at least 1 (with 0, the simulator under sim.tune_knobs instead "
        "tries every split and keeps the best; a split set here it runs as given).",
    )

    @model_validator(mode="after")
    def _sibling_needs_a_prior(self) -> SchedulerSection:
        if self.elastic_launch_order == "sibling" and self.elastic_duration_prior is None:
            raise ValueError(
                "scheduler.elastic_launch_order=sibling needs scheduler.elastic_duration_prior "
                "(mu_log_hours, sigma_log_hours, rho, timeout_hours)"
            )
        self.duration_prior()  # a degenerate model is refused here, not when the scheduler starts
        return self

    def duration_prior(self) -> DurationPrior | None:
        """The sibling order's prior from `elastic_duration_prior` (None when not set or 'auto')."""
        model = self.elastic_duration_prior
        return None if model is None or model == "auto" else DurationPrior.from_model(model)

    @property
    def fits_duration_prior(self) -> bool:
        """The sibling order's prior is fitted during the run (`elastic_duration_prior: auto`)."""
        return self.elastic_launch_order == "sibling" and self.elastic_duration_prior == "auto"

    def async_split(self, num_cells: int) -> int:
        """Cells that train under `async` on `num_cells` cells (`async_train_cells`, 0 = half, at least 1)."""
        return self.async_train_cells or max(1, num_cells // 2)
