"""Chaos benchmark: the training job run fault-free and with seeded random kills, side by side.

    python benchmarks/bench_faults.py [--steps 8 --faults 6 --seed 0 --gap-s 4 8]

Each run is the real job through `gyre_ray.train.train` on one local Ray: three tiny-model dual-role
cells (cell-0 the core), two proxy replicas, the record store, the scheduler actor, colocated
training (every cell trains each step: the non-core cells are satellites), staleness 0, float64, a
checkpoint every step. The agents are `tests/fault_workload.py`'s counting harness: 4 executions a
step, 4 streamed calls each with tool sleeps between, seeded sampling (so two runs of the job draw
the same tokens), a 429/503 retried after its Retry-After as Claude Code or Codex do.

The job runs fault-free, then with an injector that every `--gap-s` seconds (uniform, seeded) kills
one of: a rollout cell (a non-core cell while it serves), a satellite (a non-core cell while it
trains), the core (the run restarts from its newest checkpoint by itself), the record store, a
proxy replica, the scheduler actor, the `workers` actor that runs the harnesses (`ray.kill`; Ray
restarts the actors that should be, Serve the replica; `--kinds` picks among them); then fault-free
again (the overhead is taken against the mean of the two).

Reported per run: executions lost (an execution of the plan whose last start, `r<n>.<id>` after its
executor died, has no outcome of all its calls), executions started again,
records lost (calls a harness got a 200 for with no record in the store), records with a call the
harness never saw answered, steps completed and lost, wall time; for the chaos run, whether every
record has the fault-free run's tokens, the weight gap to the fault-free run after every step
(|w - w_clean|, and relative to that step's update), and the faults (when, what, what happened).
JSON under benchmarks/results/ (no machine paths).
"""

from __future__ import annotations

import argparse
import json
import random
import shutil
import sys
import tempfile
import threading
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "tests"))

KINDS = ("rollout_cell", "satellite", "core", "store", "replica", "scheduler", "workers")
DEFAULT_KINDS = KINDS[:6]  # the runs committed before `workers` could die without ending the run
CALLS = 4


def job_overrides(steps: int, name: str, root: Path) -> list[str]:
    from fault_workload import fault_overrides

    return [
        *fault_overrides(cells=3, capacity=2), "proxy.num_replicas=2", f"run.steps={steps}", f"run.name={name}",
        f"run.run_dir={root}", "run.checkpoint_every=1", "run.keep_checkpoints=0", "run.wandb_mode=disabled",
        "scheduler.policy=colocate", "scheduler.staleness=0", "run.max_core_restarts=3",
    ]  # fmt: skip


class Injector(threading.Thread):
    """Kills one thing every `gap` seconds (seeded) in the run named `name` until `stop`."""

    def __init__(
        self,
        name: str,
        seed: int,
        gap: tuple[float, float],
        faults: int,
        kinds: tuple[str, ...] = DEFAULT_KINDS,
    ) -> None:
        super().__init__(daemon=True)
        self.name, self.rng, self.gap, self.faults = name, random.Random(seed), gap, faults
        self.kinds = kinds
        self.stop = threading.Event()
        self.events: list[dict[str, Any]] = []
        self.t0 = time.monotonic()

    def run(self) -> None:
        kinds = [self.kinds[i % len(self.kinds)] for i in range(self.faults)]
        self.rng.shuffle(kinds)
        for kind in kinds:
            if self.stop.wait(self.rng.uniform(*self.gap)):
                return
            try:
                target = self._kill(kind)
            except Exception as exc:  # noqa: BLE001 - reported in the JSON, the run goes on
                target = f"skipped ({type(exc).__name__}: {exc})"
            self.events.append({"at_s": round(time.monotonic() - self.t0, 2), "kind": kind, "target": target})
            print(f"bench_faults: {self.events[-1]}", flush=True)

    def _namespace(self, wait_s: float = 60.0) -> str:
        """The Ray namespace of the run's live runtime (a new one after a core restart)."""
        import ray

        deadline = time.monotonic() + wait_s
        while not self.stop.is_set():
            spaces = {
                a["namespace"]
                for a in ray.util.list_named_actors(all_namespaces=True)
                if a["name"] == "scheduler" and a["namespace"].startswith(f"gyre-{self.name}-")
            }
            if len(spaces) == 1:
                return spaces.pop()
            if time.monotonic() > deadline:
                raise RuntimeError(f"no single live runtime (namespaces {sorted(spaces)})")
            time.sleep(0.2)
        raise RuntimeError("the run ended")

    def _cell(self, ns: str, want: str, wait_s: float = 40.0) -> str:
        """A live non-core cell whose role is `want` (rollout | train), busy if one is within half of
        `wait_s` (calls in flight; micro-batches trained and not yet exported); named with what it held."""
        import ray

        started = time.monotonic()
        while not self.stop.is_set() and time.monotonic() < started + wait_s:
            for name in self.rng.sample(["cell-1", "cell-2"], 2):
                try:
                    status = ray.get(ray.get_actor(name, namespace=ns).status.remote(), timeout=5)
                except Exception:  # noqa: BLE001 - restarting: try the other one
                    continue
                held = status["inflight"] if want == "rollout" else status.get("unexported_micro_batches", 0)
                patient = time.monotonic() > started + wait_s / 2
                if status["role"] == want and not status.get("is_core") and (held or patient):
                    what = "calls in flight" if want == "rollout" else "unexported micro-batches"
                    return f"{name} ({held} {what})"
            time.sleep(0.05)
        raise RuntimeError(f"no non-core cell was {want} within {wait_s:.0f} s")

    def _kill(self, kind: str) -> str:
        import ray

        ns = self._namespace()
        if kind in ("rollout_cell", "satellite"):
            target = self._cell(ns, "rollout" if kind == "rollout_cell" else "train")
            ray.kill(ray.get_actor(target.split()[0], namespace=ns))
            return target
        if kind == "core":
            ray.kill(ray.get_actor("cell-0", namespace=ns))
            return "cell-0"
        if kind in ("store", "scheduler", "workers"):
            ray.kill(ray.get_actor(kind, namespace=ns), no_restart=False)
            return kind
        names = sorted(
            a["name"]
            for a in ray.util.list_named_actors(all_namespaces=True)
            if a["namespace"] == "serve" and a["name"].startswith("SERVE_REPLICA::")
        )
        name = self.rng.choice(names)
        ray.kill(ray.get_actor(name, namespace="serve"))
        return name.split("#")[-1]


def run_job(steps: int, name: str, root: Path, injector: Injector | None) -> tuple[Path, dict[str, Any]]:
    """One run of the job; returns its folder and figures."""
    from fault_workload import CountingExecutor

    from gyre_ray.config import load_config
    from gyre_ray.train import train

    cfg = load_config(ROOT / "jobs/configs/toy.yaml", job_overrides(steps, name, root))
    executor = CountingExecutor(calls=CALLS, max_tokens=16, tool_s=0.3, deadline_s=600, seed=1000)
    started = time.monotonic()
    if injector is not None:
        injector.start()
    try:
        summary = train(cfg, execute=executor)
    finally:
        if injector is not None:
            injector.stop.set()
            injector.join()
    wall = time.monotonic() - started
    run_dir = Path(summary["run_dir"])
    restarts = summary.get("core_restarts", [])
    figures = {
        "wall_s": round(wall, 2),
        "steps_completed": len(summary["steps"]),
        "steps_lost": sum(r["steps_lost"] for r in restarts),
        "core_restarts": [{k: r[k] for k in ("why", "resumed_from_step", "steps_lost")} for r in restarts],
        "scheduler_restarts": summary.get("scheduler_restarts", []),
        **losses(run_dir, steps * cfg.run.tasks_per_step * cfg.algo.group_size),
        "faults": injector.events if injector is not None else [],
    }
    return run_dir, figures


def last_starts(run_dir: Path) -> dict[str, str]:
    """Each planned execution's id -> the id of its last start (`r<n>.<id>` once its executor died)."""
    from gyre_ray.agents.relaunch import planned_id, starts_of

    last: dict[str, str] = {}
    for path in (run_dir / "workspaces").iterdir():
        plan = planned_id(path.name)
        if not (path.is_dir() and plan.startswith("s") and "." not in plan):  # (<id>.home, .tmp, .eval)
            continue
        if plan not in last or starts_of(path.name) > starts_of(last[plan]):
            last[plan] = path.name
    return last


def losses(run_dir: Path, planned: int) -> dict[str, int]:
    """Executions lost (of `planned`), records lost and records whose answer the harness never saw,
    from the folder (each execution's last start)."""
    from gyre_ray.trajectory.records import read_jsonl

    last = last_starts(run_dir)
    ids = sorted(last.values())
    lost = records_lost = unanswered = 0
    for exec_id in ids:
        counted = run_dir / "workspaces" / exec_id / "counted.json"
        answered = json.loads(counted.read_text())["calls"] if counted.is_file() else 0
        path = run_dir / "records" / f"{exec_id}.jsonl"
        records = len(read_jsonl(path)) if path.exists() else 0
        lost += answered != CALLS
        records_lost += max(0, answered - records)
        unanswered += max(0, records - answered)
    return {
        "executions": len(ids),
        "executions_started_again": sum(1 for plan, exec_id in last.items() if exec_id != plan),
        "executions_lost": lost + max(0, planned - len(ids)),
        "records_lost": records_lost,
        "records_unanswered": unanswered,
    }


def same_tokens(run_dir: Path, reference: Path) -> dict[str, int]:
    """Records of `run_dir` whose prompt and output tokens equal one of the reference run's records of
    the same execution, out of the reference's record count."""
    from gyre_ray.trajectory.records import read_jsonl

    same = total = 0
    last = last_starts(run_dir)
    for path in sorted((reference / "records").glob("s*.jsonl")):
        want = [(r.input_ids, r.output_ids) for r in read_jsonl(path)]
        got_path = run_dir / "records" / f"{last.get(path.stem, path.stem)}.jsonl"
        got = [(r.input_ids, r.output_ids) for r in read_jsonl(got_path)] if got_path.exists() else []
        total += len(want)
        same += sum(1 for g in got if g in want)
    return {"records_same_tokens": same, "records_compared": total}


def weight_gaps(run_dir: Path, reference: Path, steps: int) -> list[dict[str, float]]:
    """Per step: |w - w_ref| and that over the reference's update of the step (from its checkpoints)."""
    from fault_workload import weight_distance

    from gyre_ray import checkpoint
    from gyre_ray.model.checkpoint import read_hf_weights

    def weights(folder: Path, step: int) -> dict:
        return read_hf_weights(
            checkpoint.trainer_dir(folder / "checkpoints" / checkpoint.checkpoint_name(step))
        )

    rows, before = [], None
    for step in range(1, steps + 1):
        got, want = weights(run_dir, step), weights(reference, step)
        gap = weight_distance(got, want)
        row = {"after_step": step, "gap": gap}
        if before is not None:
            update = weight_distance(want, before)
            row.update(update=update, relative=gap / update if update else float("nan"))
        rows.append(row)
        before = want
    return rows


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=8)
    parser.add_argument("--faults", type=int, default=6)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--gap-s", type=float, nargs=2, default=(4.0, 8.0))
    parser.add_argument(
        "--kinds", default=",".join(DEFAULT_KINDS), help=f"faults to draw from, of {','.join(KINDS)}"
    )
    parser.add_argument("--out", default=str(ROOT / "benchmarks" / "results" / "faults_cpu2.json"))
    args = parser.parse_args()
    kinds = tuple(k for k in args.kinds.split(",") if k)
    if not kinds or set(kinds) - set(KINDS):
        parser.error(f"--kinds: give some of {','.join(KINDS)}, got {args.kinds!r}")

    import ray
    from fault_workload import ship_by_value

    from gyre_ray.runtime.cluster import start_local_ray

    ship_by_value()
    root = Path(tempfile.mkdtemp(prefix="gyre-exec-faults-"))
    start_local_ray(num_cpus=2, include_dashboard=False, logging_level="WARNING")
    try:
        clean_dir, clean = run_job(args.steps, "faults-clean", root, None)
        print("fault-free", json.dumps(clean), flush=True)
        injector = Injector("faults-chaos", args.seed, tuple(args.gap_s), args.faults, kinds)
        chaos_dir, chaos = run_job(args.steps, "faults-chaos", root, injector)
        chaos.update(same_tokens(chaos_dir, clean_dir))
        chaos["weight_gaps"] = weight_gaps(chaos_dir, clean_dir, args.steps)
        print("chaos", json.dumps(chaos), flush=True)
        again_dir, again = run_job(args.steps, "faults-again", root, None)
        again["weight_gaps"] = weight_gaps(again_dir, clean_dir, args.steps)  # fault-free vs fault-free
        print("fault-free again", json.dumps(again), flush=True)
    finally:
        ray.shutdown()
        shutil.rmtree(root, ignore_errors=True)
    final = chaos["weight_gaps"][-1]
    report = {
        "benchmark": "faults",
        "args": {k: v for k, v in vars(args).items() if k != "out"},
        "fault_free": clean,
        "chaos": chaos,
        "fault_free_again": again,
        "final_weights_equal": bool(final.get("relative", final["gap"]) <= 1e-6),
        "overhead": round(chaos["wall_s"] / ((clean["wall_s"] + again["wall_s"]) / 2), 3),
    }
    rows = (("fault-free", clean), ("chaos", chaos), ("fault-free", again))
    print(
        f"{'run':<11} {'steps':>5} {'lost':>4} {'execs':>5} {'lost':>4} {'rec lost':>8} {'wall s':>7}\n"
        + "\n".join(
            f"{n:<11} {r['steps_completed']:>5} {r['steps_lost']:>4} {r['executions']:>5} "
            f"{r['executions_lost']:>4} {r['records_lost']:>8} {r['wall_s']:>7}"
            for n, r in rows
        )
        + f"\nrecords with the fault-free tokens: {chaos['records_same_tokens']}/{chaos['records_compared']}"
        + f"\nfinal weights vs fault-free: gap {final['gap']:.3g}, relative to the last update "
        f"{final.get('relative', float('nan')):.3g} (fault-free vs fault-free: "
        f"{again['weight_gaps'][-1].get('relative', float('nan')):.3g})"
        + f"\nfaults: {chaos['faults']}\noverhead (chaos / mean fault-free wall time): {report['overhead']}"
    )
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(report, indent=2) + "\n", encoding="utf-8")
    return 0 if chaos["executions_lost"] == 0 and chaos["records_lost"] == 0 else 1


if __name__ == "__main__":
    raise SystemExit(main())
