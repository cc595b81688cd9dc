"""The `longtail` task set: toy tasks whose executions last as long as the simulator's `nl2repo` preset says.

Durations follow the preset scaled down in time, **1 h -> 40 s** (`SECONDS_PER_HOUR`): log D = mu +
sigma (sqrt(rho) Z_task + sqrt(1 - rho) Z_exec) in log hours (mu = -0.916, sigma = 0.55, rho = 0.6:
median 24 min -> 16 s), capped at the timeout T = 1.5 h -> 60 s. An execution at the cap sleeps
past it; each task's time limit is the scaled timeout, so it is ended there and counts as timed
out. `longtail:S` is the same set scaled 1 h -> S seconds (a test or benchmark on a small machine:
`longtail:4`, median 1.6 s, timeout 6 s).

Almost all of an execution's time is tool time: the toy harness (`gyre_ray.agents.toy_agent`) reads
the schedule file the task seeds in its workspace and sleeps before each of its tool steps (standing
for builds and test runs), between its short model calls; its branches (tool calls, a retry,
sub-agents, a compaction) are the toy harness's own. The sleeps are deterministic: Z_task comes
from (seed, the execution's group, i.e. its workspace name without the last `-part`) and Z_exec
from (seed, the whole workspace name), so a rerun of the same run folder layout sleeps the same.
Rewards are graded like the toy set's (`char_coverage_evaluator`).
"""

from __future__ import annotations

import json
import math
import zlib
from typing import Any

import numpy as np

from gyre_ray.envs.base import Task
from gyre_ray.envs.toy import char_coverage_evaluator

SECONDS_PER_HOUR = 40.0
SCHEDULE_FILE = ".gyre_tool_sleeps.json"
# the nl2repo preset's duration model (gyre_ray/sim/presets.py); a test keeps them equal
MU_LOG_HOURS, SIGMA_LOG_HOURS, RHO, TIMEOUT_HOURS = -0.916, 0.55, 0.6, 1.5
TIMEOUT_S = TIMEOUT_HOURS * SECONDS_PER_HOUR
OVERRUN_S = 5.0  # how far past the timeout an execution at the cap would sleep
# share of an execution's sleep before each tool step of the toy harness (it takes turns + 2 steps,
# 4 with the default turns; extra steps sleep nothing, missing ones sleep at the end)
TOOL_SHARES = (0.15, 0.35, 0.2, 0.3)
_TOPICS = (
    ("vowels", "Write a short sentence that uses every vowel.", "aeiou"),
    ("digits", "List the digits from zero to nine.", "0123456789"),
    ("brackets", "Write a Python list of pairs, e.g. [(1, 2)].", "[](),"),
    ("greeting", "Write a friendly greeting for the README.", "Hello!"),
)


def _normal(seed: int, key: str) -> float:
    return float(np.random.default_rng([seed, zlib.crc32(key.encode())]).standard_normal())


def execution_seconds(schedule: dict[str, Any], workspace_name: str) -> float:
    """Scaled duration of the execution whose workspace is `workspace_name` (the timeout + OVERRUN_S at the cap).

    A run tag before the last `.` (`elastic.s0-lt00-vowels-1`) does not count, so runs that tag their
    execution ids (a benchmark's policies, one after the other) see the same durations.
    """
    workspace_name = workspace_name.rsplit(".", 1)[-1]
    seed = int(schedule["seed"])
    group = workspace_name.rsplit("-", 1)[0]
    rho, sigma = float(schedule["rho"]), float(schedule["sigma_log_hours"])
    z = math.sqrt(rho) * _normal(seed, "task:" + group) + math.sqrt(1 - rho) * _normal(
        seed, "exec:" + workspace_name
    )
    hours = math.exp(float(schedule["mu_log_hours"]) + sigma * z)
    scale, timeout_h = float(schedule["seconds_per_hour"]), float(schedule["timeout_hours"])
    if hours >= timeout_h:
        return timeout_h * scale + float(schedule["overrun_s"])
    return hours * scale


def tool_sleeps(schedule: dict[str, Any], workspace_name: str) -> list[float]:
    """Seconds to sleep before each tool step of the execution (sums to `execution_seconds`)."""
    total = execution_seconds(schedule, workspace_name)
    shares = [float(s) for s in schedule["tool_shares"]]
    return [total * s / sum(shares) for s in shares]


def schedule_for(seed: int = 0, seconds_per_hour: float = SECONDS_PER_HOUR) -> dict[str, Any]:
    """The schedule file's content (what the toy harness reads)."""
    return {
        "seed": seed,
        "seconds_per_hour": seconds_per_hour,
        "mu_log_hours": MU_LOG_HOURS,
        "sigma_log_hours": SIGMA_LOG_HOURS,
        "rho": RHO,
        "timeout_hours": TIMEOUT_HOURS,
        "overrun_s": OVERRUN_S,
        "tool_shares": list(TOOL_SHARES),
    }


def longtail_tasks(
    n_tasks: int = 16, seed: int = 0, seconds_per_hour: float = SECONDS_PER_HOUR
) -> list[Task]:
    """`n_tasks` graded toy tasks (cycling the toy topics) that seed the tool-sleep schedule."""
    if n_tasks < 1 or not seconds_per_hour > 0:
        raise ValueError(
            f"longtail: need n_tasks >= 1 and seconds_per_hour > 0, got {n_tasks}, {seconds_per_hour}"
        )
    files = {SCHEDULE_FILE: json.dumps(schedule_for(seed, seconds_per_hour))}
    tasks = []
    for i in range(n_tasks):
        name, prompt, targets = _TOPICS[i % len(_TOPICS)]
        tasks.append(
            Task(
                task_id=f"lt{i:02d}-{name}",
                prompt=prompt,
                evaluate=char_coverage_evaluator(targets),
                files=files,
                time_limit_s=TIMEOUT_HOURS
                * seconds_per_hour,  # the scaled timeout, whatever agents.timeout_s
            )
        )
    return tasks


def parse_scale(task_set: str) -> float | None:
    """Seconds per hour of a `longtail` task-set name: `longtail` -> 40, `longtail:4` -> 4; None if not longtail."""
    if task_set == "longtail":
        return SECONDS_PER_HOUR
    if not task_set.startswith("longtail:"):
        return None
    try:
        scale = float(task_set.split(":", 1)[1])
    except ValueError:
        scale = math.nan
    if not (scale > 0 and math.isfinite(scale)):
        raise ValueError(
            f"task set {task_set!r}: longtail:SECONDS needs a positive number of seconds per hour"
        )
    return scale
