"""Config section `sim`: discrete-event simulation of whole training runs (`gyre-ray simulate`, `plan`)."""

from __future__ import annotations

from typing import Literal

from pydantic import Field

from gyre_ray.configbase import Section

# Shortest micro-step the simulator takes (seconds; also a replayed run's costs.json): its clock
# resolves 1e-6 s, and shorter micro-steps only multiply the events (1e-4 s: minutes per run).
MIN_MICRO_STEP_S = 1e-3


class SimSection(Section):
    """Simulator settings. Costs default to the reference paper where it gives them (switches)."""

    workload: str = Field("nl2repo", description="Workload preset name or path to a workload YAML / trace.")
    steps: int = Field(48, ge=1, description="RL steps to simulate.")
    seed: int = Field(0, ge=0, description="Random seed of the synthetic workload (numpy needs >= 0).")
    cells: int = Field(
        8, ge=1, description="Cells of the simulated cluster (same device budget for any count)."
    )
    policies: list[Literal["colocate", "async", "elastic"]] = Field(
        default_factory=lambda: ["colocate", "async", "elastic"], description="Policies to compare."
    )
    tune_knobs: bool = Field(
        True,
        description="Give async its best split and elastic its best prefetch mode by simulating each "
        "(False: use scheduler.async_train_cells and elastic_prefetch / elastic_pace_s / "
        "elastic_launch_order as set; a sibling order with elastic_duration_prior auto takes "
        "the workload's duration model).",
    )
    switch_to_train_s: float = Field(8.52, ge=0, description="Rollout -> training switch (reference paper).")
    switch_to_rollout_s: float = Field(
        3.46, ge=0, description="Training -> rollout switch (reference paper)."
    )
    weight_sync_s: float = Field(
        5.0, ge=0, description="Pause of a rollout cell to load a new policy version (assumption)."
    )
    migration_pause_s: float = Field(
        8.52, ge=0, description="Pause of an execution whose cell leaves rollout (assumption: one switch)."
    )
    optimizer_step_s: float = Field(
        10.0, ge=0, description="Optimizer step on the core per update (assumption)."
    )
    grad_sync_s: float = Field(
        2.0, ge=0, description="Gradient reduction per extra cell that trained the batch (assumption)."
    )
    micro_step_s: float = Field(
        60.0,
        ge=MIN_MICRO_STEP_S,
        description="Largest training micro-step a cell claims (cell-seconds; at least 0.001).",
    )
