"""Where elastic's time above the lower bound goes: the cell-time profile of the best elastic candidate,
phase by phase (`gyre_ray.sim.waste`), for every preset at eta 1 on 2 .. 8 cells (issue 8's cases).

Per case it prints the ratio to the bound, the run's non-work as a share of cells x makespan (empty
rollout room, other training-role time, switching), the share the bound grants, and the non-work of
the first phase (before update 0), the middle phases and the last phase (after the second-to-last
update), in cell-hours. Same workloads as `tests/test_sim_near_bound*.py` (8 steps, seed 0).

Pictures: `--plot` (default docs/images/sim-waste.png) draws the non-work shares of every case
(`gyre_ray.sim.plot.plot_waste`); `--timeline PRESET:CELLS` (default nl2repo:2) draws that case's
cell-role timeline online (the best candidate) above the same executions launched longest first
(`longest_first`, clairvoyant) into docs/images/sim-timeline-<preset>-<cells>cells.png (`""` for none).
`--from-json FILE` redraws the share picture from a saved run without simulating.

Usage: python benchmarks/bench_sim_waste.py [--steps 8] [--seed 0] [--cells 2,3,...] [--out benchmarks/results]
Saves sim_waste_cpu<cores>.json.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import time
from pathlib import Path

from gyre_ray.sim.engine import SimCosts
from gyre_ray.sim.plot import plot_timelines, plot_waste
from gyre_ray.sim.presets import PRESETS
from gyre_ray.sim.runner import best_elastic
from gyre_ray.sim.timeline import SimResult
from gyre_ray.sim.waste import profile_summary
from gyre_ray.sim.workload import SampledWorkload, longest_first, sample_workload

HOUR = 3600.0
IMAGES = Path("docs/images")


def best_candidate(result: SimResult) -> str:
    """The label of the candidate `best_elastic` picked (the fastest of its sweep)."""
    sweep = result.knobs["sweep_makespan_s"]
    return min(sweep, key=sweep.get)


def case(name: str, wl: SampledWorkload, cells: int, eta: int, costs: SimCosts) -> tuple[dict, SimResult]:
    """The best elastic candidate's profile on one preset's workload and cell count, and its run."""
    result = best_elastic(wl, cells, eta, costs, record=True)
    row = {"preset": name, "best_candidate": best_candidate(result)}
    return {**row, **profile_summary(result, wl, costs.optimizer_step_s)}, result


def waste_title(steps: int, seed: int, eta: int) -> str:
    return (
        f"elastic (best candidate) at eta {eta}, {steps} steps, seed {seed}: time in which cells do no work, "
        "by kind; label = makespan / lower bound"
    )


def draw_timeline(
    name: str, wl: SampledWorkload, online: SimResult, eta: int, steps: int, seed: int, costs: SimCosts
) -> Path:
    """The case's timeline online (`online`: its best candidate, recorded) above the same executions
    launched longest first (best candidate, FIFO)."""
    cells = online.n_cells
    clairvoyant = best_elastic(longest_first(wl), cells, eta, costs, record=True, sibling=False)
    for result, how in ((online, "online"), (clairvoyant, "launched longest first (clairvoyant)")):
        result.label = f"{how}, {best_candidate(result)}"
    path = IMAGES / f"sim-timeline-{name}-{cells}cells.png"
    plot_timelines(
        [online, clairvoyant], path, wl.capacity_per_cell(cells),
        title=f"{name}, {cells} cells, eta {eta}, {steps} steps, seed {seed}: the same executions, two launch orders",
    )  # fmt: skip
    print(f"saved {path}")
    return path


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=8)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--eta", type=int, default=1)
    parser.add_argument("--cells", default="2,3,4,5,6,7,8")
    parser.add_argument("--presets", default="nl2repo,nl2repo-hard,terminal")
    parser.add_argument("--out", default="benchmarks/results")
    parser.add_argument(
        "--plot", default=str(IMAGES / "sim-waste.png"), help="the shares picture ('' for none)"
    )
    parser.add_argument("--timeline", default="nl2repo:2", help="PRESET:CELLS timeline picture ('' for none)")
    parser.add_argument("--from-json", default="", help="only redraw --plot from this saved run")
    args = parser.parse_args()
    costs = SimCosts()
    if args.from_json:
        saved = json.loads(Path(args.from_json).read_text())
        title = waste_title(saved["steps"], saved["seed"], saved["staleness"])
        print(f"saved {plot_waste(saved['cases'], args.plot, title)}")
        return
    rows = []
    timeline: tuple[str, SampledWorkload, SimResult] | None = None  # the --timeline case's own run
    print(
        f"{'preset':13s} {'cells':>5s} {'x bound':>8s} {'non-work':>9s} {'granted':>8s} {'empty':>7s} "
        f"{'train':>7s} {'switch':>7s}  {'first/middle/last phases, cell-h':>34s}  best"
    )
    started = time.monotonic()
    for name in args.presets.split(","):
        wl = sample_workload(PRESETS[name], args.steps, args.seed)
        for cells in (int(c) for c in args.cells.split(",")):
            row, result = case(name, wl, cells, args.eta, costs)
            rows.append(row)
            if args.timeline == f"{name}:{cells}":
                timeline = (name, wl, result)
            whole = cells * row["makespan_s"]
            totals = row["totals_cell_s"]
            share = {k: 100 * v / whole for k, v in totals.items()}
            first, middle, last = (v / HOUR for v in row["non_work_cell_s_by_part"].values())
            print(
                f"{name:13s} {cells:5d} {row['ratio_to_bound']:8.4f} "
                f"{100 * row['non_work_cell_s'] / whole:8.1f}% {100 * row['bound_grants_cell_s'] / whole:7.1f}% "
                f"{share['rollout_empty_s']:6.1f}% {share['train_other_s']:6.1f}% {share['switching_s']:6.1f}%  "
                f"{first:10.2f} / {middle:8.2f} / {last:8.2f}          {row['best_candidate']}",
                flush=True,
            )
    report = {
        "hardware": f"cpu{os.cpu_count()}",
        "python": platform.python_version(),
        "steps": args.steps,
        "seed": args.seed,
        "staleness": args.eta,
        "costs": vars(costs),
        "seconds": round(time.monotonic() - started, 1),
        "cases": rows,
    }
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    path = out / f"sim_waste_{report['hardware']}.json"
    path.write_text(json.dumps(report, indent=2) + "\n")
    print(f"saved {path}")
    if args.plot:
        print(f"saved {plot_waste(rows, args.plot, waste_title(args.steps, args.seed, args.eta))}")
    if args.timeline:
        if timeline is None:  # a case the sweep left out
            name, _, cells_text = args.timeline.partition(":")
            wl = sample_workload(PRESETS[name], args.steps, args.seed)
            timeline = (name, wl, best_elastic(wl, int(cells_text), args.eta, costs, record=True))
        draw_timeline(*timeline, args.eta, args.steps, args.seed, costs)


if __name__ == "__main__":
    main()
