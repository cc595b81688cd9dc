"""Config section `agents`: which harness runs the executions, on which tasks, within what time."""

from __future__ import annotations

from typing import Literal

from pydantic import Field

from gyre_ray.configbase import Section


class AgentSection(Section):
    """Harness, task set and the per-execution time budget."""

    harness: Literal["toy", "claude-code"] = Field("toy", description="Agent harness started per execution.")
    task_set: Literal["toy", "longtail"] = Field(
        "toy", description="Named task set the executions are drawn from (longtail: set timeout_s=60)."
    )
    timeout_s: float = Field(
        600.0, gt=0, description="Wall-clock limit of one execution; its workspace is scored afterwards."
    )
    max_parallel: int = Field(8, ge=1, description="Executions running at once.")
    toy_turns: int = Field(2, ge=1, description="Main-agent turns of the toy harness before its retry.")
    toy_max_tokens: int = Field(16, ge=1, description="max_tokens of each toy-harness model call.")
