"""The driver dies: on a persistent Ray cluster a new driver attaches and the run finishes as if nothing happened.

A Ray head started for this module (`ray start --head`, tests/ray_head.py); `gyre-ray train` drivers
join it through RAY_ADDRESS, as under `ray job submit`. The toy job (2 steps, one task of 2 samples a
step, the `longtail:20` task set so executions last seconds, float64, on-policy) runs once
undisturbed; then again, its driver SIGKILLed while step 0's executions run (the run goes on without
a driver: an execution in flight ends); then again, its driver SIGKILLed while step 1's executions
run and its scheduler actor killed after it (Ray restarts the actor, which resumes the run from its
journal by itself: the run ends with no driver). Each time `gyre-ray train --attach RUN_DIR` takes
the run over (or collects it) and finishes it. Shown: every
execution launched ended with an outcome (0 executions lost), every execution's records equal the
undisturbed run's (0 records lost: same calls, same sampled tokens), every
step logged once, summary.json written, the final weights equal to the undisturbed run's (<= 1e-6
relative to the last update), and no actor or placement group of any run left on the cluster, also after a driver
stopped by SIGTERM (what `ray job stop` sends) mid-step.
"""

from __future__ import annotations

import json
import re
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path

import pytest
from ray_head import cluster_env, free_port, ray_head

from gyre_ray import checkpoint
from gyre_ray.live_run import LIVE_FILE
from gyre_ray.model.checkpoint import read_hf_weights
from gyre_ray.runtime.journal import JOURNAL_NAME
from gyre_ray.trajectory.records import read_jsonl

pytestmark = [pytest.mark.slow, pytest.mark.extended]  # `make test-extended`
ROOT = Path(__file__).resolve().parents[1]
GYRE = str(Path(sys.executable).with_name("gyre-ray"))
OVERRIDES = [
    "run.steps=2", "run.tasks_per_step=1", "algo.group_size=2", "scheduler.staleness=0",
    "trainer.lr=1e-3", "model.dtype=float64", "agents.task_set=longtail:20", "run.checkpoint_every=1",
    "run.keep_checkpoints=0", "run.wandb_mode=disabled", "cells.cpus_per_cell=1",
    "algo.train_zero_advantage=true",  # every step trains (a version each), whatever its rewards
]  # fmt: skip
RUN_FOLDER = re.compile(r"gyre-ray: run folder (\S+)")


def _driver(args: list[str], address: str, log: Path) -> subprocess.Popen:
    with open(log, "w") as out:
        return subprocess.Popen(
            [GYRE, "train", *args], cwd=ROOT, env=cluster_env(address), stdout=out, stderr=subprocess.STDOUT
        )


def _train(name: str, root: Path) -> list[str]:
    return ["--config", "jobs/configs/toy.yaml", *OVERRIDES, f"run.run_dir={root}", f"run.name={name}",
            f"proxy.port={free_port()}"]  # fmt: skip


def _finish(driver: subprocess.Popen, log: Path, timeout_s: float = 900.0) -> str:
    try:
        driver.wait(timeout=timeout_s)
    except subprocess.TimeoutExpired:
        driver.kill()
        driver.wait()
    text = log.read_text()
    assert driver.returncode == 0, text[-4000:]
    return text


def _journal(run_dir: Path) -> list[dict]:
    path = run_dir / JOURNAL_NAME
    lines = path.read_text().splitlines() if path.is_file() else []
    events = []
    for line in lines:
        try:
            events.append(json.loads(line))
        except ValueError:  # a line being written
            break
    return events


def _published(run_dir: Path, step: int) -> bool:
    return any(e.get("published") == step for e in _journal(run_dir))


def _executions(run_dir: Path) -> tuple[set[int], set[int]]:
    """(launched, ended) execution indices by the scheduler's journal."""
    events = _journal(run_dir)
    return {e["launched"] for e in events if "launched" in e}, {e["ended"] for e in events if "ended" in e}


def _wait_for(what: str, check, timeout_s: float = 600.0):
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        value = check()
        if value:
            return value
        time.sleep(0.2)
    raise AssertionError(f"timed out waiting for {what}")


LEFTOVER = """
import json, ray
ray.init()
actors = [a for a in ray.util.list_named_actors(all_namespaces=True) if a["namespace"].startswith("gyre-")]
groups = [g["name"] for g in ray.util.placement_group_table().values()
          if g["name"].startswith("gyre-") and g["state"] != "REMOVED"]
print(json.dumps(actors + groups))
"""


def _leftovers(address: str) -> list:
    """The runs' named actors and placement groups still on the cluster."""
    out = subprocess.run([sys.executable, "-c", LEFTOVER], env=cluster_env(address), capture_output=True,
                         text=True, timeout=300, check=True)  # fmt: skip
    return json.loads(out.stdout.strip().splitlines()[-1])


def _stopped_run(root: Path, address: str) -> dict:
    """A driver sent SIGTERM (what `ray job stop` sends) mid-step: it stops the run and its actors."""
    log = root / "stopped.log"
    driver = _driver(_train("stopped", root), address, log)
    run_dir = Path(_wait_for("the run folder", lambda: RUN_FOLDER.search(log.read_text())).group(1))
    _wait_for("step 0 under way", lambda: _in_step(0)(run_dir))
    driver.send_signal(signal.SIGTERM)
    driver.wait(timeout=300)
    return {"run_dir": run_dir, "returncode": driver.returncode, "leftover": _leftovers(address)}


class SchedulerKiller:
    """A process joined to the cluster ahead of time that kills the run's scheduler actor's process on
    cue (Ray restarts the actor, with no driver alive to send it `run` again), so the kill follows the driver's at once."""

    CODE = (
        "import sys, ray; ray.init(); ns = sys.argv[1]; print('ready', flush=True); sys.stdin.readline(); "
        "ray.kill(ray.get_actor('scheduler', namespace=ns), no_restart=False); print('killed', flush=True)"
    )

    def __init__(self, address: str, namespace: str) -> None:
        self.process = subprocess.Popen(
            [sys.executable, "-c", self.CODE, namespace], env=cluster_env(address), text=True,
            stdin=subprocess.PIPE, stdout=subprocess.PIPE,
        )  # fmt: skip
        assert self.process.stdout.readline().strip() == "ready"

    def kill(self) -> None:
        self.process.stdin.write("kill\n")
        self.process.stdin.flush()
        assert self.process.stdout.readline().strip() == "killed"
        self.process.wait(timeout=60)


def _in_step(step: int):
    """The moment to kill: step `step`'s executions running (a record of it written), earlier steps logged."""

    def check(run_dir: Path) -> bool:
        launched, ended = _executions(run_dir)
        first = 2 * step  # execution indices of the step (2 a step)
        running = {e for e in launched - ended if e >= first}
        metrics = run_dir / "metrics.jsonl"
        logged = len(metrics.read_text().splitlines()) if metrics.is_file() else 0
        records = list((run_dir / "records").glob(f"s{step}-*.jsonl"))
        return (run_dir / LIVE_FILE).is_file() and bool(running) and bool(records) and logged == step

    return check


def _killed_run(name: str, root: Path, address: str, step: int, scheduler_too: bool) -> dict:
    """A run whose driver is SIGKILLed during step `step` (and its scheduler actor killed after it),
    then taken over by `gyre-ray train --attach`."""
    log = root / f"{name}.log"
    first = _driver(_train(name, root), address, log)
    run_dir = Path(_wait_for("the run folder", lambda: RUN_FOLDER.search(log.read_text())).group(1))
    killer = None
    if scheduler_too:
        live = _wait_for("the live-run file", lambda: (run_dir / LIVE_FILE).is_file() and run_dir / LIVE_FILE)
        killer = SchedulerKiller(address, json.loads(live.read_text())["namespace"])
    _wait_for(f"step {step} under way", lambda: _in_step(step)(run_dir))
    launched, ended = _executions(run_dir)
    first.send_signal(signal.SIGKILL)
    killed_at = time.monotonic()
    first.wait(timeout=60)
    in_flight = launched - ended
    if killer is not None:  # the restarted scheduler resumes the run by itself: it ends with no driver
        killer.kill()
        _wait_for("the last step published with no driver", lambda: _published(run_dir, step), 600)
    else:  # without a driver the run goes on: an execution in flight at the kill ends
        _wait_for("an execution ending with no driver", lambda: _executions(run_dir)[1] & in_flight, 300)
    driverless_s = time.monotonic() - killed_at
    attach_log = root / f"{name}-attach.log"
    attached = _finish(_driver(["--attach", str(run_dir)], address, attach_log), attach_log)
    print(f"{name}: killed in step {step} with executions {sorted(in_flight)} running; "
          f"{driverless_s:.1f} s without a driver; attach took {time.monotonic() - killed_at - driverless_s:.1f} s")  # fmt: skip
    return {"run_dir": run_dir, "attached": attached, "in_flight": in_flight, "launched_at_kill": launched}


@pytest.fixture(scope="module")
def runs() -> Iterator[dict]:
    # outside pytest's basetemp, like the other job tests (sandboxed executions; conftest.exec_tmp)
    root = Path(tempfile.mkdtemp(prefix="gyre-exec-test-"))
    with ray_head(num_cpus=4) as address:
        clean_log = root / "clean.log"
        clean = _finish(_driver(_train("clean", root), address, clean_log), clean_log)
        driver = _killed_run("driver", root, address, step=0, scheduler_too=False)
        both = _killed_run("both", root, address, step=1, scheduler_too=True)
        stopped = _stopped_run(root, address)
        again = subprocess.run([GYRE, "train", "--attach", str(driver["run_dir"])], cwd=ROOT,
                               env=cluster_env(address), capture_output=True, text=True, timeout=300)  # fmt: skip
        yield {
            "clean": Path(RUN_FOLDER.search(clean).group(1)), "driver": driver, "both": both, "again": again,
            "stopped": stopped, "leftover": _leftovers(address),
        }  # fmt: skip
    shutil.rmtree(root, ignore_errors=True)


def _records(run_dir: Path) -> dict[str, list[list[int]]]:
    return {
        p.stem: [r.output_ids for r in read_jsonl(p)] for p in sorted((run_dir / "records").glob("s*.jsonl"))
    }


KILLS = ("driver", "both")  # the driver killed in step 0; the driver and the scheduler killed in step 1


@pytest.mark.parametrize("kill", KILLS)
def test_the_attached_driver_finishes_every_step(runs: dict, kill: str) -> None:
    run, run_dir = runs[kill], runs[kill]["run_dir"]
    assert run["in_flight"], "the driver must die while executions run"
    logged_before = 0 if kill == "driver" else 1
    assert f"attached to the live run; {logged_before} of its step(s) logged before" in run["attached"]
    summary = json.loads((run_dir / "summary.json").read_text())
    assert [m["step"] for m in summary["steps"]] == [0, 1]
    assert [m["version"] for m in summary["steps"]] == [1, 2]
    rows = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in rows] == [0, 1]  # each step logged once, by one driver or the other
    assert not (run_dir / LIVE_FILE).exists()
    assert checkpoint.load_state(checkpoint.latest(run_dir))["step"] == 2
    restarts = summary["scheduler_restarts"]
    if kill == "both":  # the restarted scheduler took the run up from its journal by itself
        assert len(restarts) == 1 and restarts[0]["executions_reattached"] >= 1, restarts
    else:
        assert restarts == []


@pytest.mark.parametrize("kill", KILLS)
def test_no_execution_and_no_record_is_lost(runs: dict, kill: str) -> None:
    run_dir, clean = runs[kill]["run_dir"], runs["clean"]
    launched, ended = _executions(run_dir)
    assert launched == ended == {0, 1, 2, 3} and runs[kill]["launched_at_kill"] <= launched
    trace = [json.loads(line) for line in (run_dir / "trace.jsonl").read_text().splitlines()]
    assert len(trace) == 4 and not any(row["dropped"] for row in trace), trace
    print(kill, [(row["exec_id"], row["calls"], row.get("timed_out")) for row in trace])
    records, reference = _records(run_dir), _records(clean)
    assert records.keys() == reference.keys() and len(records) == 4
    for exec_id, calls in records.items():  # the same calls, the same sampled tokens
        assert calls == reference[exec_id] and calls, exec_id
    by_id = {row["exec_id"]: row for row in trace}
    assert all(by_id[e]["calls"] == len(calls) for e, calls in records.items())


@pytest.mark.parametrize("kill", KILLS)
def test_the_final_weights_equal_the_undisturbed_runs(runs: dict, kill: str) -> None:
    def weights(run_dir: Path, step: int) -> dict:
        return read_hf_weights(checkpoint.trainer_dir(run_dir / "checkpoints" / f"step-{step:06d}"))

    final, reference = weights(runs[kill]["run_dir"], 2), weights(runs["clean"], 2)
    before = weights(runs["clean"], 1)
    gap = sum(float(((final[k] - reference[k]) ** 2).sum()) for k in reference) ** 0.5
    update = sum(float(((reference[k] - before[k]) ** 2).sum()) for k in reference) ** 0.5
    print(f"{kill}: |w - w_clean| = {gap:.3g}, last update {update:.3g}, relative {gap / update:.3g}")
    assert update > 0 and gap / update <= 1e-6


def test_nothing_is_left_on_the_cluster_and_a_second_attach_points_at_resume(runs: dict) -> None:
    assert runs["leftover"] == []  # after a clean run and two attached ones
    again = runs["again"]
    assert again.returncode == 2 and "--resume" in again.stderr, again.stderr  # the driver run's, finished


def test_sigterm_stops_the_run_and_its_actors(runs: dict) -> None:
    stopped = runs["stopped"]
    # `ray.init`'s SIGTERM handler raises SystemExit: the clean-up runs (the driver then exits
    # non-zero: measured -6, an abort in Ray's exit after the clean-up)
    assert stopped["returncode"] != 0
    assert stopped["leftover"] == [] and not (stopped["run_dir"] / LIVE_FILE).exists()
