"""Real harnesses and task files through the training job (local Ray, tiny model, elastic step):
the mini NL2Repo set with the toy harness and with Claude Code, and hostile executions that end
scored or dropped with their reasons in the step's metrics while the job finishes."""

from __future__ import annotations

import json
import os
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest
from local_ray import private_ray

from gyre_ray.agents.harnesses import claude_binary
from gyre_ray.config import load_config
from gyre_ray.envs.nl2repo import nl2repo_mini_path
from gyre_ray.train import train
from gyre_ray.trajectory.records import read_jsonl

ROOT = Path(__file__).resolve().parents[1]
pytestmark = pytest.mark.slow
SECRET = "wandb-secret-in-the-job"


@pytest.fixture(scope="module", autouse=True)
def job_ray() -> Iterator[None]:
    """One Ray (and Serve) for the module's jobs. The job's secret is in its environment before Ray
    starts, so the workers that run executions inherit it, as in a job that starts its own Ray."""
    with pytest.MonkeyPatch.context() as patch:
        patch.setenv("WANDB_API_KEY", SECRET)
        with private_ray():
            yield


def _train(run_root: Path, *overrides: str) -> dict:
    base = [f"run.run_dir={run_root}", "run.steps=1", "run.tasks_per_step=1", "run.wandb_mode=disabled"]
    return train(load_config(ROOT / "jobs/configs/toy.yaml", [*base, *overrides]))


def _reports(run_dir: Path) -> list[str]:
    from gyre_ray.envs.task_scoring import pytest_junit_share

    return [pytest_junit_share(p).detail for p in sorted(run_dir.glob("workspaces/*.eval/report.xml"))]


def test_the_mini_nl2repo_set_runs_through_the_job_with_the_toy_harness(exec_tmp: Path) -> None:
    summary = _train(exec_tmp, "agents.task_set=nl2repo-mini", "algo.group_size=2", "agents.toy_turns=1")
    (step,) = summary["steps"]
    run_dir = Path(summary["run_dir"])
    assert step["executions"] == 2 and step["valid"] == 2 and step["dropped"] == 0
    # the toy agent writes answer.txt, not the package: every hidden test fails, so the share is 0
    assert step["reward_mean"] == 0.0 and _reports(run_dir) == ["0/1 hidden tests passed"] * 2
    assert not list(run_dir.glob("workspaces/s0-*-?/test_*.py")), "hidden tests leaked into a workspace"
    assert step["calls"] > 0 and step["loss_tokens"] > 0
    # equal rewards, advantage 0: counted, not trained, and the step takes no optimizer step
    assert step["executions_untrained"] == 2 and step["micro_batches"] == 0 and "loss" not in step
    assert "advantage 0" in step["skipped"] and step["version"] == 0


def test_hostile_executions_end_with_reasons_and_the_job_finishes(exec_tmp: Path, monkeypatch) -> None:
    monkeypatch.setenv("WANDB_API_KEY", SECRET)
    hidden = nl2repo_mini_path().parent / "hidden/rlekit"
    task = {
        "id": "rle",
        "prompt": "Build rlekit (see spec).",
        "hidden": str(hidden),
        "evaluator": {"score": "pytest"},
    }
    task_file = exec_tmp / "hostile.jsonl"
    task_file.write_text(json.dumps(task) + "\n")
    summary = _train(
        exec_tmp / "runs", f"agents.task_set={task_file}", "algo.group_size=4", "agents.harness=command",
        f"agents.command=[{sys.executable}, {ROOT / 'tests/hostile_harness.py'}]", "agents.timeout_s=90",
        "agents.max_processes=32", "agents.max_disk_mb=64", "agents.max_file_mb=16",
    )  # fmt: skip
    (step,) = summary["steps"]
    reasons = step["execution_reasons"]
    assert step["executions"] == 4 and step["valid"] == 3 and step["dropped"] == 1, reasons
    assert step["drop_reasons"] == {"no model calls": 1} and reasons["s0-rle-1"] == "no model calls"
    assert "process limit (32)" in reasons["s0-rle-2"] and "disk limit (64 MiB)" in reasons["s0-rle-3"]
    assert "s0-rle-0" not in reasons  # the clean one
    assert step["reward_mean"] == pytest.approx(0.5 / 3)  # 2/4 hidden tests, then two zeros
    assert "loss" in step  # the step trained on the three scored executions
    run_dir = Path(summary["run_dir"])
    spy = json.loads((run_dir / "workspaces/s0-rle-2/spy.json").read_text())
    assert spy.pop("env_secrets") == []
    assert spy and all(str(v).startswith("DENIED") for v in spy.values()), spy
    calls = [
        p for p in (run_dir / "records").glob("*.jsonl") if not p.name.startswith(".")
    ]  # not the store's registry
    assert {r.execution_id for p in calls for r in read_jsonl(p)} == {
        "s0-rle-0", "s0-rle-2", "s0-rle-3",
    }  # fmt: skip


# Under CI (make install-harnesses installs it) a missing Claude Code fails instead of skipping.
@pytest.mark.skipif(
    claude_binary() is None and os.environ.get("CI") != "true",
    reason="Claude Code is not installed; run: make install-harnesses",
)
def test_claude_code_trains_in_the_job_on_the_mini_nl2repo_set(exec_tmp: Path) -> None:
    assert claude_binary() is not None, "make install-harnesses must install Claude Code (CI runs this test)"
    # Claude Code as root through the job: it runs as an unprivileged uid of its own. Its built-in
    # tools are cut to Write and its system prompt shortened so the tiny model's CPU prefill stays short.
    summary = _train(
        exec_tmp, "agents.task_set=nl2repo-mini", "algo.group_size=2", "agents.harness=claude-code",
        "agents.harness_args=[--tools, Write, --system-prompt, You are a coding agent. Write the files.]",
        "proxy.max_output_tokens=12", "agents.timeout_s=240",
        "algo.train_zero_advantage=true",  # both may score 0: their records are trained all the same
    )  # fmt: skip
    (step,) = summary["steps"]
    run_dir = Path(summary["run_dir"])
    records = [r for p in (run_dir / "records").glob("s0-*.jsonl") for r in read_jsonl(p)]
    assert step["executions"] == 2 and step["valid"] + step["dropped"] == 2
    # every execution reached the policy through the proxy (none dropped as "no model calls")
    assert len({r.execution_id for r in records}) == 2, sorted({r.execution_id for r in records})
    assert records and {r.role for r in records} <= {"main", "sub-agent", "main-summary", "sub-agent-summary"}
    assert all(r.meta["api"] == "anthropic-messages" for r in records)
    assert _reports(run_dir) and all(d.endswith("hidden tests passed") for d in _reports(run_dir))
    # it trains: at least one execution was scored, its tokens became micro-batches, the update ran
    assert step["valid"] >= 1 and step["reward_mean"] is not None, step
    assert "loss" in step and step["micro_batches"] > 0 and step["version"] == 1, step
    assert sum(step["trained_by_cell"].values()) == step["micro_batches"], step
