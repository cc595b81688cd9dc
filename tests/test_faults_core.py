"""The core cell dies: the run restarts from its newest checkpoint by itself and loses at most one step.

The slow test runs the real job (local Ray, tiny model, 2 dual-role cells, toy harness, staleness 0,
a checkpoint every step, 3 steps) in a thread, waits until the step-1 checkpoint is in the run folder,
`ray.kill`s the core actor (`cell-0`) and checks that the same `train` call finishes all 3 steps in
the same folder, each step's metrics and each execution's trace row once, with the restart in its
summary. The fast tests check the restart rows without Ray (a checkpoint to resume from, and none yet).
"""

from __future__ import annotations

import json
import shutil
import tempfile
import threading
import time
from pathlib import Path

import pytest

from gyre_ray import checkpoint
from gyre_ray.core_restart import CoreLost, describe, plan_restart, restart_row
from gyre_ray.runtime.cluster import start_local_ray
from tests import test_cli_inputs_eval as eval_inputs

ROOT = Path(__file__).resolve().parents[1]
good_run = eval_inputs.good_run  # a fixture: a run folder with a loadable checkpoint of step 3
OVERRIDES = [
    "run.name=corekill",
    "run.steps=3",
    "run.tasks_per_step=1",
    "algo.group_size=2",
    "algo.train_zero_advantage=true",  # every step trains (a version each), whatever its rewards
    "cells.num_cells=2",
    "scheduler.staleness=0",
    "agents.toy_turns=1",
    "agents.toy_max_tokens=8",
    "run.checkpoint_every=1",
    "run.keep_checkpoints=0",
    "run.wandb_mode=disabled",
    "proxy.port=0",
]


def _marker(folder: Path) -> None:
    folder.mkdir(parents=True)
    (folder / "weights.bin").write_bytes(b"w")


def test_restart_row_resumes_from_the_newest_checkpoint(tmp_path: Path) -> None:
    checkpoint.save(tmp_path, 1, _marker, {})
    checkpoint.save(tmp_path, 2, _marker, {})
    row = restart_row(
        checkpoint.latest(tmp_path), CoreLost("the core cell cell-0 died (RayActorError)", 3), 1
    )
    assert row["resumed_from_step"] == 2 and row["steps_lost"] == 1
    assert row["checkpoint"].endswith("step-000002")
    assert "from checkpoint" in describe(row, 2) and "restart 1 of 2" in describe(row, 2)


def test_restart_row_without_a_checkpoint_starts_the_run_again(tmp_path: Path) -> None:
    row = restart_row(None, CoreLost("gone", 0), 1)
    assert row["checkpoint"] is None and row["resumed_from_step"] == 0 and row["steps_lost"] == 0
    assert "from the start of the run (no checkpoint yet)" in describe(row, 2)


def test_a_restart_skips_a_damaged_newest_checkpoint_and_its_row_says_so(
    good_run: Path, tmp_path: Path
) -> None:
    """The row and the line name the checkpoint the restart resumes from, not a damaged newer one."""
    run_dir = eval_inputs._with_damaged_newest(good_run, tmp_path, "{garbage")
    warnings: list[str] = []
    row, resumed = plan_restart(run_dir, CoreLost("gone", 5), 1, warn=warnings.append)
    good = run_dir / checkpoint.CHECKPOINTS / checkpoint.checkpoint_name(3)
    assert resumed == good and row["checkpoint"] == str(good)
    assert row["resumed_from_step"] == 3 and row["steps_lost"] == 2
    assert (
        len(warnings) == 1 and "skipping damaged checkpoint" in warnings[0] and "step-000004" in warnings[0]
    )
    assert f"from checkpoint {good} (step 3), 2 finished step(s) lost" in describe(row, 2)


def _kill_core_after(root: Path, step: int, done: threading.Event, timeout_s: float = 300.0) -> dict:
    """Wait for checkpoint `step` of the run under `root`, then kill its core; returns what was seen."""
    import ray

    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline and not done.is_set():
        found = list(root.glob(f"corekill-*/checkpoints/{checkpoint.checkpoint_name(step)}/state.json"))
        if found:
            run_dir = found[0].parents[2]
            names = ray.util.list_named_actors(all_namespaces=True)
            spaces = [a["namespace"] for a in names if a["name"] == "cell-0"]
            spaces = [s for s in spaces if s.startswith("gyre-corekill-")]
            assert len(spaces) == 1, names
            ray.kill(ray.get_actor("cell-0", namespace=spaces[0]))
            steps = [p.name for p in checkpoint.complete_checkpoints(run_dir)]
            return {"run_dir": run_dir, "at": time.monotonic(), "checkpoints": steps}
        time.sleep(0.05)
    raise AssertionError(f"no checkpoint {step} appeared (or the run ended first)")


@pytest.mark.slow
@pytest.mark.extended  # `make test-extended`: a whole job killed and restarted
def test_core_killed_after_a_checkpoint_the_run_restarts_and_finishes(capsys) -> None:
    import ray

    from gyre_ray.config import load_config
    from gyre_ray.train import train

    start_local_ray(num_cpus=2, include_dashboard=False, logging_level="WARNING")
    root = Path(tempfile.mkdtemp(prefix="gyre-exec-test-"))  # outside basetemp (see conftest.exec_tmp)
    outcome: dict = {}
    done = threading.Event()

    def job() -> None:
        try:
            cfg = load_config(ROOT / "jobs/configs/toy.yaml", [*OVERRIDES, f"run.run_dir={root}"])
            outcome["summary"] = train(cfg)
        except BaseException as exc:  # reported by the assertions below
            outcome["error"] = exc
        finally:
            done.set()

    started = time.monotonic()
    thread = threading.Thread(target=job, daemon=True)
    thread.start()
    try:
        try:
            killed = _kill_core_after(root, 1, done)
        except AssertionError as exc:
            raise AssertionError(f"{exc}; the job: {outcome.get('error')!r}") from None
        thread.join(timeout=600)
    finally:
        from ray import serve

        serve.shutdown()
        ray.shutdown()
    try:
        assert "error" not in outcome, outcome.get("error")
        summary = outcome["summary"]
        took = time.monotonic() - started
        restarts = summary["core_restarts"]
        out = capsys.readouterr().out
        with capsys.disabled():
            print(f"killed with checkpoints {killed['checkpoints']}; restarts {restarts}; "
                  f"run took {took:.1f} s, {time.monotonic() - killed['at']:.1f} s after the kill")  # fmt: skip
        assert Path(summary["run_dir"]) == killed["run_dir"]
        assert [m["step"] for m in summary["steps"]] == [0, 1, 2]
        assert len(restarts) == 1, restarts
        row = restarts[0]
        assert row["resumed_from_step"] >= 1 and row["steps_lost"] <= 1, row
        assert row["updates_done"] - row["resumed_from_step"] <= 1, row
        final = checkpoint.latest(killed["run_dir"])
        assert checkpoint.load_state(final)["step"] == 3
        lines = (killed["run_dir"] / "metrics.jsonl").read_text().splitlines()
        assert len(lines) == 3, "each step's metrics once: the dead segment's later rows were set aside"
        trace = [json.loads(line) for line in (killed["run_dir"] / "trace.jsonl").read_text().splitlines()]
        assert sorted(r["step"] for r in trace) == [0, 0, 1, 1, 2, 2], (
            "each execution once, the dead segment's too"
        )
        assert len({r["exec_id"] for r in trace}) == 6
        resumed = row["resumed_from_step"]
        before = max(r["end"] for r in trace if r["step"] < resumed)
        assert before <= min(r["start"] for r in trace if r["step"] >= resumed), (
            "the new segment's clock follows"
        )
        assert "the core cell cell-0 died (" in out and "restarting the run from checkpoint" in out
    finally:
        shutil.rmtree(root, ignore_errors=True)
