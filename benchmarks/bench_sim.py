"""Scheduling policies at cluster scale: 48 steps on each workload preset, 8 cells, same sampled workload.

Runs, per preset (all on the same draw of executions):
- `colocate`           on-policy by construction (staleness 0);
- `async eta=0`        best fixed split (every split 1..7 trainers simulated), on-policy;
- `elastic eta=0`      on-policy: compared with colocate and async eta=0 at matched staleness;
- `async eta=1`        best fixed split with staleness bound 1;
- `elastic eta=1`      best prefetch mode (eager, spare, trickle, paced): compared with async eta=1.
Every run reports makespan, its lower bound (at the staleness it may use), utilisation, mean
staleness and switches. The bound also says what speedup is possible at all: no schedule beats it,
so elastic can be at most X / bound faster than a run X at the same staleness. Targets (reference
paper): elastic within 10% of the bound; on nl2repo-like presets >= 1.21x over colocate and
>= 1.78x over async.

Then the cell-count sweep (`--sweep-steps`, default 12 steps): elastic (best prefetch mode) over
the bound on every preset, at eta 0 and 1, on 2 .. 8 cells (issue 8's target: within 5% of the
bound everywhere). `--sweep-only` runs just the sweep and saves sim_cells_cpu<cores>.json.
`--oracle-order` adds, at eta >= 1, elastic on the same executions launched longest first within
each batch (`longest_first`: a clairvoyant order no online policy has), which separates what the
launch order costs from what the rest of the schedule does.

Also checks the nl2repo fit (colocate on the reference's 4 cells: 1.906 h per step) and times one
48 x 8 x 1,024 simulation (target < 30 s).

Usage: python benchmarks/bench_sim.py [--steps 48] [--cells 8] [--seed 0] [--out benchmarks/results]
Saves sim_cpu<cores>.json (`--stem NAME`: NAME_cpu<cores>.json).
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import time
from pathlib import Path

from gyre_ray.sim.bound import lower_bound
from gyre_ray.sim.engine import SimCosts
from gyre_ray.sim.presets import PRESETS
from gyre_ray.sim.runner import best_async, best_elastic, run_policy
from gyre_ray.sim.timeline import SimResult
from gyre_ray.sim.workload import longest_first, sample_workload

HOUR = 3600.0
TARGET_VS_COLOCATE, TARGET_VS_ASYNC, TARGET_BOUND = 1.21, 1.78, 1.10


def row(result: SimResult, steps: int) -> dict:
    return {
        **result.summary(),
        "makespan_h": round(result.makespan_s / HOUR, 3),
        "h_per_step": round(result.makespan_s / HOUR / steps, 4),
        "lower_bound_h": round(result.lower_bound_s / HOUR, 3),
    }


def bench_preset(name: str, steps: int, cells: int, seed: int, costs: SimCosts) -> dict:
    wl = sample_workload(PRESETS[name], steps, seed)
    runs = {
        "colocate": run_policy(wl, "colocate", cells, 0, costs),
        "async eta=0": best_async(wl, cells, 0, costs),
        "elastic eta=0": best_elastic(wl, cells, 0, costs),
        "async eta=1": best_async(wl, cells, 1, costs),
        "elastic eta=1": best_elastic(wl, cells, 1, costs),
    }
    lb0 = lower_bound(wl, cells, 0, costs.optimizer_step_s)
    lb1 = lower_bound(wl, cells, 1, costs.optimizer_step_s)
    ms = {k: r.makespan_s for k, r in runs.items()}
    speedups = {
        "elastic_vs_colocate_eta0": ms["colocate"] / ms["elastic eta=0"],
        "elastic_vs_async_eta0": ms["async eta=0"] / ms["elastic eta=0"],
        "elastic_vs_async_eta1": ms["async eta=1"] / ms["elastic eta=1"],
        "elastic_eta1_vs_colocate": ms["colocate"] / ms["elastic eta=1"],
    }
    possible = {
        "vs_colocate_eta0": ms["colocate"] / lb0.total_s,
        "vs_async_eta0": ms["async eta=0"] / lb0.total_s,
        "vs_async_eta1": ms["async eta=1"] / lb1.total_s,
    }
    return {
        "workload": PRESETS[name].model_dump(exclude_none=True),
        "runs": {k: row(r, steps) for k, r in runs.items()},
        "bound": {
            "eta0_h": round(lb0.total_s / HOUR, 3),
            "eta0_chain_h": round(lb0.chain_s / HOUR, 3),
            "eta0_work_h": round(lb0.work_s / HOUR, 3),
            "eta1_h": round(lb1.total_s / HOUR, 3),
            "eta1_chain_h": round(lb1.chain_s / HOUR, 3),
            "eta1_work_h": round(lb1.work_s / HOUR, 3),
        },
        "speedups": {k: round(v, 4) for k, v in speedups.items()},
        "max_possible_speedups": {k: round(v, 4) for k, v in possible.items()},
        "targets": {
            "elastic_within_10pct_of_bound": all(
                runs[k].makespan_s <= TARGET_BOUND * runs[k].lower_bound_s
                for k in ("elastic eta=0", "elastic eta=1")
            ),
            "vs_colocate_1.21x": speedups["elastic_vs_colocate_eta0"] >= TARGET_VS_COLOCATE,
            "vs_colocate_1.21x_possible": possible["vs_colocate_eta0"] >= TARGET_VS_COLOCATE,
            "vs_async_1.78x": max(speedups["elastic_vs_async_eta0"], speedups["elastic_vs_async_eta1"])
            >= TARGET_VS_ASYNC,
            "vs_async_1.78x_possible": max(possible["vs_async_eta0"], possible["vs_async_eta1"])
            >= TARGET_VS_ASYNC,
        },
    }


def sweep_cells(name: str, steps: int, seed: int, costs: SimCosts, oracle_order: bool = False) -> dict:
    """elastic / bound for eta 0, 1 and 2 .. 8 cells on one sampled workload (and, with
    `oracle_order`, at eta >= 1 on the same workload launched longest first)."""
    wl = sample_workload(PRESETS[name], steps, seed)
    oracle_wl = longest_first(wl) if oracle_order else None
    table: dict = {}
    for eta in (0, 1):
        for cells in range(2, 9):
            elastic = best_elastic(wl, cells, eta, costs)
            entry = table[f"eta={eta} cells={cells}"] = {
                "elastic_x_bound": round(elastic.makespan_s / elastic.lower_bound_s, 4),
                "elastic_h_per_step": round(elastic.makespan_s / HOUR / steps, 4),
                "bound_h_per_step": round(elastic.lower_bound_s / HOUR / steps, 4),
                "prefetch": elastic.knobs.get("prefetch"),
                "launch_order": elastic.knobs.get("launch_order", "fifo"),
            }
            if oracle_wl is not None and eta:
                oracle = best_elastic(oracle_wl, cells, eta, costs, sibling=False)  # keep longest first
                entry["oracle_order_x_bound"] = round(oracle.makespan_s / oracle.lower_bound_s, 4)
                entry["oracle_order_prefetch"] = oracle.knobs.get("prefetch")
        for key, label in (("elastic_x_bound", "elastic"), ("oracle_order_x_bound", "longest-first")):
            cells_ = [c for c in range(2, 9) if key in table[f"eta={eta} cells={c}"]]
            if cells_:
                line = " ".join(f"{c}:{table[f'eta={eta} cells={c}'][key]:.3f}" for c in cells_)
                print(f"  {name:13s} eta={eta} {label} x bound by cells  {line}", flush=True)
    return table


def print_preset(name: str, data: dict, steps: int) -> None:
    b = data["bound"]
    print(
        f"\n{name}: bound {b['eta0_h'] / steps:.3f} h/step on-policy, {b['eta1_h'] / steps:.3f} h/step at eta=1"
    )
    print(
        f"  {'run':15s} {'h/step':>7s} {'total h':>8s} {'x bound':>7s} {'util':>6s} {'stale':>6s} {'sw':>5s}  knobs"
    )
    for label, r in data["runs"].items():
        knobs = {k: v for k, v in r["knobs"].items() if k != "sweep_makespan_s"}
        print(
            f"  {label:15s} {r['h_per_step']:7.3f} {r['makespan_h']:8.2f} {r['ratio_to_bound']:7.3f} "
            f"{r['utilization']:6.1%} {r['mean_staleness']:6.2f} {r['switches']:5d}  {knobs}"
        )
    s, p = data["speedups"], data["max_possible_speedups"]
    print(
        f"  elastic vs colocate (eta=0): {s['elastic_vs_colocate_eta0']:.3f}x (bound allows {p['vs_colocate_eta0']:.3f}x,"
        f" target {TARGET_VS_COLOCATE}x)"
    )
    for eta in (0, 1):
        print(
            f"  elastic vs async    (eta={eta}): {s[f'elastic_vs_async_eta{eta}']:.3f}x "
            f"(bound allows {p[f'vs_async_eta{eta}']:.3f}x, target {TARGET_VS_ASYNC}x)"
        )
    print(f"  elastic eta=1 vs colocate (not matched): {s['elastic_eta1_vs_colocate']:.3f}x")


def bench_main(args: argparse.Namespace, costs: SimCosts, report: dict) -> None:
    """Timing, the nl2repo fit and the 8-cell comparison of every policy per preset."""
    wl = sample_workload(PRESETS["nl2repo"], 48, args.seed)
    start = time.perf_counter()
    run_policy(wl, "elastic", 8, 1, costs)
    elapsed = time.perf_counter() - start
    report["timing"] = {"elastic_48x8x1024_s": round(elapsed, 2), "target_s": 30.0, "ok": elapsed < 30.0}
    print(f"timing: elastic, 48 steps x 8 cells x 1,024 executions: {elapsed:.1f} s (target < 30 s)")
    fit = run_policy(wl, "colocate", 4, 0, costs).makespan_s / 48 / HOUR
    report["fit_checks"] = {
        "nl2repo_colocate_4_cells_h_per_step": round(fit, 4),
        "reference_h_per_step": 1.9056,
    }
    print(f"fit: nl2repo colocate on 4 cells {fit:.3f} h/step (reference 91.47 h / 48 = 1.906 h)")
    for name in args.presets.split(","):
        t0 = time.perf_counter()
        report["presets"][name] = bench_preset(name, args.steps, args.cells, args.seed, costs)
        print_preset(name, report["presets"][name], args.steps)
        print(f"  ({time.perf_counter() - t0:.0f} s)")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=48)
    parser.add_argument("--cells", type=int, default=8)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--presets", default="nl2repo,terminal,nl2repo-hard")
    parser.add_argument("--out", default="benchmarks/results")
    parser.add_argument(
        "--stem", default="", help="name of the JSON file (default: sim, or sim_cells with --sweep-only)"
    )
    parser.add_argument("--sweep-steps", type=int, default=12, help="steps of the 2..8-cell sweep (0: skip)")
    parser.add_argument("--sweep-only", action="store_true", help="only the 2..8-cell sweep")
    parser.add_argument(
        "--oracle-order",
        action="store_true",
        help="sweep at eta 1 also with each batch launched longest first",
    )
    args = parser.parse_args()
    costs = SimCosts()
    report: dict = {
        "hardware": f"cpu{os.cpu_count()}",
        "python": platform.python_version(),
        "steps": args.steps,
        "cells": args.cells,
        "seed": args.seed,
        "costs": vars(costs),
        "presets": {},
    }
    if not args.sweep_only:
        bench_main(args, costs, report)
    if args.sweep_steps:
        print(f"\ncell-count sweep, {args.sweep_steps} steps (target: elastic within 5% of the bound)")
        report["cells_sweep"] = {
            "steps": args.sweep_steps,
            "target_x_bound": 1.05,
            "oracle_order": args.oracle_order,
            "presets": {},
        }
        for name in args.presets.split(","):
            report["cells_sweep"]["presets"][name] = sweep_cells(
                name, args.sweep_steps, args.seed, costs, args.oracle_order
            )
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    stem = args.stem or ("sim_cells" if args.sweep_only else "sim")
    path = out / f"{stem}_{report['hardware']}.json"
    path.write_text(json.dumps(report, indent=2) + "\n")
    print(f"\nsaved {path}")


if __name__ == "__main__":
    main()
