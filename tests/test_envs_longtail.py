"""The `longtail` task set: nl2repo-shaped durations scaled 1 h -> 40 s, deterministic, honoured by the toy harness."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path
from types import SimpleNamespace

import numpy as np
import pytest

from gyre_ray.agents import toy_agent
from gyre_ray.agents.config import AgentSection
from gyre_ray.envs import get_task_set
from gyre_ray.envs import longtail as lt
from gyre_ray.sim.presets import PRESETS
from gyre_ray.sim.workload import sample_workload


def names(steps: int = 4, tasks: int = 64, group: int = 16) -> list[list[str]]:
    """Workspace names as the runtime makes them (execution ids `s{step}-{task}-{g}`), by group."""
    return [[f"s{s}-lt{t:02d}-x-{g}" for g in range(group)] for s in range(steps) for t in range(tasks)]


def test_the_duration_model_is_the_nl2repo_preset_scaled_1h_to_40s() -> None:
    preset = PRESETS["nl2repo"].duration
    assert (
        preset.mu_log_hours,
        preset.sigma_log_hours,
        preset.rho,
        preset.timeout_hours,
    ) == (lt.MU_LOG_HOURS, lt.SIGMA_LOG_HOURS, lt.RHO, lt.TIMEOUT_HOURS)
    assert lt.SECONDS_PER_HOUR == 40.0 and lt.TIMEOUT_S == 60.0


def test_durations_follow_the_simulated_preset_in_distribution() -> None:
    schedule = lt.schedule_for(seed=3)
    groups = names()
    real = np.array([[lt.execution_seconds(schedule, n) for n in g] for g in groups])
    wl = sample_workload(PRESETS["nl2repo"], steps=4, seed=3)
    sim = np.minimum(wl.duration_s / 3600.0, lt.TIMEOUT_HOURS) * lt.SECONDS_PER_HOUR
    capped = np.minimum(real, lt.TIMEOUT_S)
    for q in (0.1, 0.5, 0.9, 0.99):
        assert np.quantile(capped, q) == pytest.approx(np.quantile(sim, q), rel=0.12)
    # the timeout: a few executions hit it and sleep past it; the task part is shared within a group
    at_cap = real >= lt.TIMEOUT_S
    assert 0 < at_cap.mean() < 0.05 and np.all(real[at_cap] == lt.TIMEOUT_S + lt.OVERRUN_S)
    logs = np.log(capped)
    within = logs.var(axis=1).mean()
    assert within == pytest.approx((1 - lt.RHO) * lt.SIGMA_LOG_HOURS**2, rel=0.15)


def test_sleeps_are_deterministic_per_execution_and_seed_and_sum_to_its_duration() -> None:
    a, b = lt.schedule_for(seed=0), lt.schedule_for(seed=1)
    name = "s2-lt05-greeting-7"
    assert lt.tool_sleeps(a, name) == lt.tool_sleeps(dict(a), name)
    assert lt.tool_sleeps(a, name) != lt.tool_sleeps(b, name)
    assert lt.tool_sleeps(a, name) != lt.tool_sleeps(a, "s2-lt05-greeting-8")
    sleeps = lt.tool_sleeps(a, name)
    assert len(sleeps) == len(lt.TOOL_SHARES) and sum(sleeps) == pytest.approx(lt.execution_seconds(a, name))


def test_the_task_set_is_registered_and_seeds_its_schedule(tmp_path: Path) -> None:
    tasks = get_task_set("longtail")
    assert len(tasks) == 16 and len({t.task_id for t in tasks}) == 16
    assert AgentSection(task_set="longtail").task_set == "longtail"
    assert lt.SCHEDULE_FILE == ".gyre_tool_sleeps.json"  # the name the toy harness looks for
    tasks[0].seed_workspace(tmp_path / "ws")
    assert json.loads((tmp_path / "ws" / lt.SCHEDULE_FILE).read_text()) == lt.schedule_for()
    assert tasks[0].evaluate(tmp_path / "ws").reward == 0.0  # graded on answer.txt, like toy
    with pytest.raises(ValueError, match="unknown task set"):
        get_task_set("nope")


class _Client:
    """Stands for the OpenAI SDK: every call answers a short text, no tool call."""

    def __init__(self) -> None:
        self.chat = SimpleNamespace(completions=SimpleNamespace(create=self._create))
        self.calls = 0

    def _create(self, **_: object) -> SimpleNamespace:
        self.calls += 1
        message = SimpleNamespace(content="aeiou", tool_calls=None)
        return SimpleNamespace(choices=[SimpleNamespace(message=message)])


@pytest.mark.parametrize("turns", [1, 2, 4])
def test_the_toy_harness_sleeps_the_schedule_between_its_model_calls(
    tmp_path: Path, monkeypatch, turns
) -> None:
    workspace = tmp_path / "s0-lt01-digits-3"
    get_task_set("longtail")[1].seed_workspace(workspace)
    slept: list[tuple[int, float]] = []
    client = _Client()
    monkeypatch.setattr(toy_agent.time, "sleep", lambda s: slept.append((client.calls, s)))
    toy_agent.ToyAgent(client, workspace, "List the digits.", seed=1).run(turns=turns)
    expected = lt.tool_sleeps(lt.schedule_for(), workspace.name)
    assert sum(s for _, s in slept) == pytest.approx(sum(expected))
    assert [s for _, s in slept][: min(turns + 2, 4)] == pytest.approx(expected[: min(turns + 2, 4)])
    assert len({calls for calls, _ in slept}) >= 3  # tool time falls between different model calls
    assert (workspace / "answer.txt").is_file()


def test_the_toy_harness_does_not_sleep_on_toy_tasks(tmp_path: Path, monkeypatch) -> None:
    slept: list[float] = []
    monkeypatch.setattr(toy_agent.time, "sleep", slept.append)
    get_task_set("toy")[0].seed_workspace(tmp_path / "ws")
    toy_agent.ToyAgent(_Client(), tmp_path / "ws", "Write.", seed=1).run()
    assert sum(slept) == 0


def test_a_scaled_set_shrinks_durations_and_time_limits_and_a_run_tag_does_not_count() -> None:
    fast = get_task_set("longtail:4")
    assert [t.task_id for t in fast] == [t.task_id for t in get_task_set("longtail")]
    assert {t.time_limit_s for t in fast} == {6.0} and {t.time_limit_s for t in get_task_set("longtail")} == {
        60.0
    }
    schedule = json.loads(fast[0].files[lt.SCHEDULE_FILE])
    name = "s1-lt00-vowels-2"
    assert lt.execution_seconds(schedule, name) == pytest.approx(
        lt.execution_seconds(lt.schedule_for(), name) / 10
    )
    assert lt.execution_seconds(schedule, "elastic-eta1." + name) == lt.execution_seconds(schedule, name)
    assert AgentSection(task_set="longtail:4").task_set == "longtail:4"
    for bad in ("longtail:0", "longtail:x", "longtail:-1", "longtail:nan"):
        with pytest.raises(ValueError, match="positive number of seconds per hour"):
            AgentSection(task_set=bad)


def test_the_run_seed_gives_other_draws_and_seed_0_keeps_the_default(tmp_path: Path, monkeypatch) -> None:
    name = "s0-lt01-digits-3"
    assert toy_agent.execution_seed(name) == toy_agent.execution_seed(name, 0)  # 0: name only, as before
    assert toy_agent.execution_seed(name, 7) != toy_agent.execution_seed(name)
    # a start again after the executor died (`r1.<name>`, `r2.<name>`) draws the planned one's seeds
    assert toy_agent.execution_seed("r1." + name, 7) == toy_agent.execution_seed("r2." + name, 7)
    assert toy_agent.execution_seed("r1." + name, 7) == toy_agent.execution_seed(name, 7)
    # reproducible: another process (another hash seed, as a resumed run or a rerun is) draws the same
    code = f"from gyre_ray.agents.toy_agent import execution_seed as s; print(s({name!r}), s({name!r}, 7))"
    other = subprocess.run(
        [sys.executable, "-c", code], env={**os.environ, "PYTHONHASHSEED": "12345"},
        capture_output=True, text=True, check=True, timeout=120,
    )  # fmt: skip
    here = [toy_agent.execution_seed(name), toy_agent.execution_seed(name, 7)]
    assert other.stdout.split() == [str(seed) for seed in here]
    workspace = tmp_path / name
    get_task_set("longtail")[1].seed_workspace(workspace)
    totals = {}
    for run_seed in (0, 7):
        slept: list[float] = []
        monkeypatch.setattr(toy_agent.time, "sleep", slept.append)
        toy_agent.ToyAgent(_Client(), workspace, "List the digits.", seed=1, run_seed=run_seed).run(turns=2)
        totals[run_seed] = sum(slept)
    assert totals[0] == pytest.approx(sum(lt.tool_sleeps(lt.schedule_for(), name)))
    assert totals[7] == pytest.approx(sum(lt.tool_sleeps(lt.schedule_for(seed=7), name)))
    assert totals[7] != pytest.approx(totals[0])


def test_a_planned_execution_hands_the_run_seed_to_the_harness(tmp_path: Path, monkeypatch) -> None:
    from gyre_ray.agents import launch
    from gyre_ray.agents.config import AgentSection
    from gyre_ray.agents.runner import Endpoint

    seen: dict = {}
    monkeypatch.setattr(launch, "run_execution", lambda *a, **kw: seen.update(kw["env_extra"]))
    section = AgentSection(isolation="none").model_dump()
    endpoint = Endpoint("http://127.0.0.1:1", "k")
    launch.run_planned_execution(
        "s0-lt01-digits-0", "longtail", "lt01-digits", endpoint, str(tmp_path / "w"), section, run_seed=5
    )
    assert seen["GYRE_RUN_SEED"] == "5"


@pytest.mark.parametrize(
    ("name", "value", "expected"),
    [("GYRE_RUN_SEED", "five", "an integer"), ("GYRE_TOY_TOP_P", "high", "a number")],
)
def test_the_toy_harness_names_a_setting_that_is_not_a_number(
    tmp_path: Path, monkeypatch, capsys, name: str, value: str, expected: str
) -> None:
    monkeypatch.setenv("GYRE_WORKSPACE", str(tmp_path))
    monkeypatch.setenv("GYRE_TASK_PROMPT", "write hello.txt")
    monkeypatch.setenv(name, value)
    assert toy_agent.main() == 2
    assert capsys.readouterr().err.strip() == f"toy_agent: {name}={value!r} is not {expected}"
