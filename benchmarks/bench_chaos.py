"""Chaos benchmark: a short job run fault-free, then again with random faults injected, side by side.

    python benchmarks/bench_chaos.py [--steps 3 --faults 5 --seed 0 --gap-s 4 8]

One local Ray, one `Runtime`: three tiny-model dual-role cells (cell-0 the core), two proxy replicas
behind Serve's HTTP proxy, the durable record store, the scheduler actor, and
`tests/fault_workload.py`'s counting harness (4 executions a step, each a fixed number of streamed
calls with tool sleeps in between; a harness retries a 429/503 after its Retry-After, as Claude
Code or Codex do). The same job runs twice on the same cells: first with no fault, then with a
seeded injector that, every `--gap-s` seconds (uniform in the range), kills one of: a non-core cell
(`cell-1`/`cell-2`), the record store, a proxy replica, the scheduler actor (`ray.kill`, the
process dies; Ray restarts the actor where the runtime asks for it, Serve replaces the replica, the
scheduler restarts dead cells). The core's loss (a restart from the checkpoint, `tests/test_faults_core.py`)
is not injected: it ends this runtime by design.

The fault-free job runs before and after the chaos run (the overhead is taken against their mean,
so warm-up does not favour either side). Reported per run: executions that did not end valid (lost), calls a harness got a 200 for without a
record in the store (records lost), steps completed, wall time, and the faults injected (when, what);
the overhead is chaos wall time / mean fault-free wall time. JSON under benchmarks/results/.
"""

from __future__ import annotations

import argparse
import json
import random
import sys
import threading
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "tests"))

KINDS = ("cell", "store", "replica", "scheduler")


def _losses(folder: Path, result: dict[str, Any], ok: int) -> dict[str, int]:
    """Executions not ended valid, 200-answered calls without a record, records beyond the 200s.

    A valid execution got exactly `ok` 200s (the counting harness raises otherwise)."""
    from gyre_ray.trajectory.records import read_jsonl

    lost = records_lost = extra = calls = 0
    for row in result["trace"]:
        path = folder / "records" / f"{row['exec_id']}.jsonl"
        records = len(read_jsonl(path)) if path.exists() else 0
        answered = 0 if row["dropped"] else ok
        lost += bool(row["dropped"])
        records_lost += max(0, answered - records)
        extra += max(0, records - answered)  # a call whose record landed but whose answer the kill cut
        calls += answered
    return {
        "executions_lost": lost,
        "records_lost": records_lost,
        "records_unanswered": extra,
        "calls": calls,
    }


class Injector(threading.Thread):
    """Kills one thing every `gap` seconds (seeded) until `stop`; `events` says what and when."""

    def __init__(self, runtime: Any, seed: int, gap: tuple[float, float], faults: int) -> None:
        super().__init__(daemon=True)
        self.rt, self.rng, self.gap, self.faults = runtime, random.Random(seed), gap, faults
        self.stop = threading.Event()
        self.events: list[dict[str, Any]] = []
        self.t0 = time.monotonic()

    def run(self) -> None:
        kinds = [KINDS[i % len(KINDS)] for i in range(self.faults)]
        self.rng.shuffle(kinds)
        for kind in kinds:
            if self.stop.wait(self.rng.uniform(*self.gap)):
                return
            try:
                target = self._kill(kind)
            except Exception as exc:  # e.g. the cell was still restarting: nothing to kill this time
                target = f"skipped ({type(exc).__name__}: {exc})"
            self.events.append({"at_s": round(time.monotonic() - self.t0, 2), "kind": kind, "target": target})

    def _kill(self, kind: str) -> str:
        import ray

        ns = self.rt.namespace
        if kind == "cell":
            name = self.rng.choice(["cell-1", "cell-2"])
            actor = ray.get_actor(name, namespace=ns)
            ray.get(actor.status.remote(), timeout=5)  # alive (not restarting)
            ray.kill(actor)
            return name
        if kind == "store":
            ray.kill(ray.get_actor("store", namespace=ns), no_restart=False)
            return "store"
        if kind == "scheduler":
            ray.kill(self.rt.scheduler, no_restart=False)
            return "scheduler"
        names = sorted(
            a["name"]
            for a in ray.util.list_named_actors(all_namespaces=True)
            if a["namespace"] == "serve" and a["name"].startswith(f"SERVE_REPLICA::{self.rt.app_name}")
        )
        name = self.rng.choice(names)
        ray.kill(ray.get_actor(name, namespace="serve"))
        return name


def _run(
    rt: Any, steps: int, tag: str, folder: Path, injector: Injector | None, calls: int
) -> dict[str, Any]:
    import ray

    started = time.monotonic()
    ref = rt.scheduler.run.remote(steps, scheduler={"policy": "elastic", "staleness": 0}, tag=tag)
    if injector is not None:
        injector.start()
    result = ray.get(ref, timeout=3600)
    wall = time.monotonic() - started
    if injector is not None:
        injector.stop.set()
        injector.join()
    return {
        "steps_completed": len(result["steps"]),
        "executions": len(result["trace"]),
        "wall_s": round(wall, 2),
        **_losses(folder, result, calls),
        "cell_faults": len(result["faults"]),
        "cells_restarted": sum(bool(f.get("restarted")) for f in result["faults"]),
        "scheduler_restarts": result.get("scheduler_restarts", []),
        "faults": injector.events if injector is not None else [],
    }


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=3)
    parser.add_argument("--faults", type=int, default=5)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--gap-s", type=float, nargs=2, default=(4.0, 8.0))
    parser.add_argument("--calls", type=int, default=4, help="model calls per execution")
    parser.add_argument("--out", default=str(ROOT / "benchmarks" / "results" / "chaos_cpu2.json"))
    args = parser.parse_args()

    import tempfile

    import ray
    from fault_workload import CountingExecutor, fault_overrides, ship_by_value
    from ray import serve

    from gyre_ray.config import load_config
    from gyre_ray.runtime.cluster import Runtime, start_local_ray

    ship_by_value()
    folder = Path(tempfile.mkdtemp(prefix="gyre-chaos-"))
    overrides = [*fault_overrides(cells=3, capacity=2), "proxy.num_replicas=2", "model.dtype=float32"]
    cfg = load_config("jobs/configs/toy.yaml", [*overrides, f"proxy.records_dir={folder / 'records'}"])
    start_local_ray(num_cpus=2, include_dashboard=False, logging_level="WARNING")  # retries a slow start
    executor = CountingExecutor(calls=args.calls, max_tokens=16, tool_s=0.3, deadline_s=600)
    rt = Runtime.start(cfg, scheduler_options={"run_dir": str(folder), "execute": executor}, timeout_s=600)
    try:
        clean = _run(rt, args.steps, "clean-", folder, None, args.calls)
        print("fault-free", json.dumps(clean))
        injector = Injector(rt, args.seed, tuple(args.gap_s), args.faults)
        chaos = _run(rt, args.steps, "chaos-", folder, injector, args.calls)
        print("chaos", json.dumps(chaos))
        after = _run(rt, args.steps, "after-", folder, None, args.calls)  # fault-free again: warm-up fair
        print("fault-free again", json.dumps(after))
    finally:
        rt.shutdown()
        serve.shutdown()
        ray.shutdown()
    report = {
        "benchmark": "chaos",
        "args": {k: v for k, v in vars(args).items() if k != "out"},  # no machine path
        "fault_free": clean,
        "chaos": chaos,
        "fault_free_after": after,
        "overhead": round(chaos["wall_s"] / ((clean["wall_s"] + after["wall_s"]) / 2), 3),
    }
    print(
        f"{'run':<11} {'steps':>5} {'execs':>5} {'lost':>4} {'rec lost':>8} {'calls':>5} {'wall s':>7}\n"
        + "\n".join(
            f"{name:<11} {r['steps_completed']:>5} {r['executions']:>5} {r['executions_lost']:>4} "
            f"{r['records_lost']:>8} {r['calls']:>5} {r['wall_s']:>7}"
            for name, r in (("fault-free", clean), ("chaos", chaos), ("fault-free", after))
        )
        + f"\nfaults: {chaos['faults']}\noverhead (chaos / mean fault-free wall time): {report['overhead']}"
    )
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(report, indent=2) + "\n", encoding="utf-8")
    return 0 if chaos["executions_lost"] == 0 and chaos["records_lost"] == 0 else 1


if __name__ == "__main__":
    raise SystemExit(main())
