"""The runtime's policies side by side on real cells: colocate, async (every split), elastic at eta 0 and 1.

    python benchmarks/bench_runtime.py [--cells 4 --cpus-per-cell 0.5 --steps 6 ...]

One local Ray, one `Runtime` (tiny-model dual-role cells behind the proxy, the `scheduler` actor) and
the `longtail` task set's executions (durations from the simulator's nl2repo preset with one hour
scaled to `--hour-s` seconds), run in-process by `tests/longtail_workload.py` (short model calls
between tool-call sleeps; why not the toy harness on this machine: see that file). Every policy runs
the same steps on the same cells with the same execution durations (a pure function of the execution
id without its run tag), one after the other (the weights carry on from run to run). Per run:
makespan (first launch to last update published), per-cell utilisation (rolling out = hosting at
least one execution, training, switching, idle), switches, trained-token staleness, reward; each
run's trace.jsonl and costs.json go under `--runs-dir/<run>/`, and, where `gyre-ray simulate --trace`
exists, its replay of each run is kept. Prints a table and saves JSON under benchmarks/results/.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
from pathlib import Path
from typing import Any

from gyre_ray.train import scored_rewards

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "tests"))


def _configs(cells: int) -> list[tuple[str, dict[str, Any]]]:
    runs = [("colocate", {"policy": "colocate", "staleness": 0})]
    runs += [
        (f"async-{k}t-eta1", {"policy": "async", "staleness": 1, "async_train_cells": k})
        for k in range(1, cells)
    ]
    runs += [
        ("elastic-eta0", {"policy": "elastic", "staleness": 0}),
        ("elastic-eta1", {"policy": "elastic", "staleness": 1}),
        ("elastic-eta1-spare", {"policy": "elastic", "staleness": 1, "elastic_prefetch": "spare"}),
    ]
    return runs


def _simulate(run_dir: Path, section: dict[str, Any]) -> dict[str, Any]:
    """The simulator's replay of the run (`gyre-ray simulate --trace RUN_DIR`) with the run's own scheduler
    section (the run folder has no config.json, whose section the replay would read): predicted vs
    measured makespan."""
    from gyre_ray.scheduling.config import SchedulerSection
    from gyre_ray.sim.replay import predict_run

    try:
        report = predict_run(run_dir, scheduler=SchedulerSection.model_validate(section))
    except Exception as exc:  # a replay failure is reported, the benchmark's figures stand
        return {"available": False, "detail": f"{type(exc).__name__}: {exc}"}
    row = report["policies"][report["recorded_policy"]]
    return {"available": True, **row}


def _row(name: str, result: dict[str, Any]) -> dict[str, Any]:
    steps = result["steps"]
    rewards = scored_rewards(steps)
    util = result["utilisation"]
    return {
        "run": name,
        "makespan_s": round(result["costs"]["makespan_s"], 2),
        "switches": len(result["switches"]),
        "staleness_max": max(m["staleness"]["max"] for m in steps),
        "staleness_mean": round(statistics.fmean(m["staleness"]["mean"] for m in steps), 3),
        "overlap_s": round(sum(m["overlap_s"] for m in steps), 2),
        "reward_mean": round(statistics.fmean(rewards), 4),
        "utilisation": util,
        "mean_utilisation": {
            k: round(statistics.fmean(u[k] for u in util.values()), 3)
            for k in ("rollout", "training", "switching", "idle")
        },
        "costs": result["costs"],
        "steps": [
            {
                k: m[k]
                for k in ("step", "step_seconds", "staleness", "overlap_s", "reward_mean", "micro_batches")
            }
            for m in steps
        ],
    }


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--cells", type=int, default=4)
    parser.add_argument("--cpus-per-cell", type=float, default=0.5)
    parser.add_argument("--capacity", type=int, default=2, help="executions one rollout cell carries")
    parser.add_argument("--steps", type=int, default=6)
    parser.add_argument("--tasks-per-step", type=int, default=2)
    parser.add_argument("--group-size", type=int, default=4)
    parser.add_argument("--hour-s", type=float, default=4.0, help="seconds standing for one hour of nl2repo")
    parser.add_argument("--tool-s", type=float, default=0.5, help="one tool sleep between model calls")
    parser.add_argument("--max-tokens", type=int, default=8, help="max_tokens of each model call")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--only", default="", help="comma-separated run names (default: all)")
    parser.add_argument("--runs-dir", default=str(ROOT / "runs" / "bench_runtime"))
    parser.add_argument("--out", default=str(ROOT / "benchmarks" / "results" / "runtime_cpu2.json"))
    args = parser.parse_args()

    import ray
    from longtail_workload import LongTailExecutor, ship_by_value

    from gyre_ray.config import load_config
    from gyre_ray.runtime.cluster import Runtime
    from gyre_ray.runtime.report import write_costs, write_trace

    ship_by_value()
    runs_dir = Path(args.runs_dir) / time.strftime("%Y%m%d-%H%M%S")
    overrides = [
        f"cells.num_cells={args.cells}", f"cells.cpus_per_cell={args.cpus_per_cell}", f"cells.capacity={args.capacity}",
        f"run.tasks_per_step={args.tasks_per_step}", f"algo.group_size={args.group_size}", "proxy.port=0",
        f"proxy.records_dir={runs_dir / 'records'}", f"agents.task_set=longtail:{args.hour_s:g}",
    ]  # fmt: skip
    cfg = load_config(ROOT / "jobs/configs/toy.yaml", overrides)
    executor = LongTailExecutor(
        hour_s=args.hour_s, tool_s=args.tool_s, max_tokens=args.max_tokens, seed=args.seed
    )
    ray.init(address="local", num_cpus=os.cpu_count() or 2, include_dashboard=False, logging_level="WARNING")
    started = time.perf_counter()
    options = {"run_dir": str(runs_dir), "execute": executor}
    runtime = Runtime.start(cfg, scheduler_options=options, timeout_s=600)
    print(
        f"runtime up in {time.perf_counter() - started:.1f} s: {args.cells} cells x {args.cpus_per_cell} CPU",
        flush=True,
    )
    load_before = [round(x, 2) for x in os.getloadavg()]
    wanted = set(filter(None, args.only.split(",")))
    rows = []
    try:
        for name, section in _configs(args.cells):
            if wanted and name not in wanted:
                continue
            run_dir = runs_dir / name
            run_dir.mkdir(parents=True, exist_ok=True)
            t = time.perf_counter()
            result = ray.get(
                runtime.scheduler.run.remote(
                    args.steps, scheduler=section, run_dir=str(run_dir), tag=f"{name}."
                )
            )
            write_trace(run_dir, result["trace"])
            write_costs(run_dir, result["costs"])
            row = _row(name, result)
            row["wall_s"] = round(time.perf_counter() - t, 1)
            rows.append(row)
            print(f"{name:16s} makespan {row['makespan_s']:7.2f} s  switches {row['switches']:3d}  staleness max "
                  f"{row['staleness_max']} mean {row['staleness_mean']:.2f}  overlap {row['overlap_s']:6.1f} s  "
                  f"reward {row['reward_mean']:.3f}  util {row['mean_utilisation']}", flush=True)  # fmt: skip
    finally:
        runtime.shutdown()
        from ray import serve

        serve.shutdown()
        ray.shutdown()
    sections = dict(_configs(args.cells))
    for row in rows:
        row["simulated"] = _simulate(runs_dir / row["run"], sections[row["run"]])
    by = {r["run"]: r["makespan_s"] for r in rows}
    asyncs = {k: v for k, v in by.items() if k.startswith("async-")}
    ratios = {}
    if "elastic-eta1" in by and "colocate" in by:
        ratios["colocate / elastic-eta1"] = round(by["colocate"] / by["elastic-eta1"], 3)
    if "elastic-eta1" in by and asyncs:
        best = min(asyncs, key=asyncs.get)
        ratios[f"best async ({best}) / elastic-eta1"] = round(asyncs[best] / by["elastic-eta1"], 3)
    if "elastic-eta1-spare" in by and asyncs:
        best = min(asyncs, key=asyncs.get)
        ratios["colocate / elastic-eta1-spare"] = round(by["colocate"] / by["elastic-eta1-spare"], 3)
        ratios[f"best async ({best}) / elastic-eta1-spare"] = round(
            asyncs[best] / by["elastic-eta1-spare"], 3
        )
    if "elastic-eta0" in by and "colocate" in by:
        ratios["colocate / elastic-eta0"] = round(by["colocate"] / by["elastic-eta0"], 3)
    print(
        "\n| run | makespan s | simulated s (x measured) | switches | staleness max / mean | overlap s | reward "
        "| rollout / training / switching / idle |"
    )
    print("|---|---|---|---|---|---|---|---|")
    for r in rows:
        u, sim = r["mean_utilisation"], r["simulated"]
        predicted = (
            f"{sim['predicted_makespan_s']:.1f} ({sim.get('predicted_over_measured', float('nan')):.3f})"
            if sim.get("available")
            else "n/a"
        )
        print(f"| {r['run']} | {r['makespan_s']:.1f} | {predicted} | {r['switches']} | {r['staleness_max']} / "
              f"{r['staleness_mean']:.2f} | {r['overlap_s']:.1f} | {r['reward_mean']:.3f} | {u['rollout']:.2f} / "
              f"{u['training']:.2f} / {u['switching']:.2f} / {u['idle']:.2f} |")  # fmt: skip
    for k, v in ratios.items():
        print(f"{k}: {v}x")
    out = {
        "machine": {"cpus": os.cpu_count(), "note": "2-core machine shared with other jobs"},
        "args": {k: v for k, v in vars(args).items() if k not in ("out", "runs_dir")},  # no machine paths
        "task_set": cfg.agents.task_set,
        "executor": executor.__dict__,
        "load_average_before": load_before,
        "load_average_after": [round(x, 2) for x in os.getloadavg()],
        "runs_dir": runs_dir.name,  # the run's folder under --runs-dir
        "ratios": ratios,
        "runs": rows,
    }
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(out, indent=2))
    print(f"saved {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
