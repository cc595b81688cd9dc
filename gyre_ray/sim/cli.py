"""`gyre-ray simulate` (compare policies on a workload) and `gyre-ray plan` (recommend a cell layout).

Both are pure Python and fast to start: heavy imports stay inside the handlers.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import sys
from pathlib import Path
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from gyre_ray.scheduling.config import SchedulerSection

HOUR = 3600.0
# Longest `--plot-hours` (in hours it must stay finite: 1e308 hours are infinite seconds).
MAX_PLOT_HOURS = 1_000_000.0
# Most cells one simulation takes (and nodes `plan` splits): the engine keeps per-cell state and
# async tries every split, so more only runs out of memory or time.
MAX_CELLS = 10_000
POLICY_NAMES = "colocate, async, elastic"


def _policy_list(text: str) -> list[str]:
    """The names in a comma-separated `--policies` value (blanks dropped)."""
    return [p.strip() for p in text.split(",") if p.strip()]


def _override_keys(overrides: list[str]) -> dict[str, str]:
    """Each dotted key the overrides set (`section.key`), mapped to the override that sets it; an
    override giving a whole section as a mapping (`scheduler={staleness: 2}`) sets each of its keys."""
    from gyre_ray.config import parse_override

    keys: dict[str, str] = {}
    for text in overrides:
        parts, value = parse_override(text)
        if len(parts) == 1 and isinstance(value, dict) and value:
            keys.update({f"{parts[0]}.{key}": text for key in value})
        else:
            keys[".".join(parts)] = text
    return keys


def _policy_override_problem(keys: dict[str, str], default: str) -> str | None:
    """Why a `scheduler.policy` override cannot apply to `simulate` (it runs `--policies`), or None."""
    text = keys.get("scheduler.policy")
    if text is None:
        return None
    key, _, value = text.partition("=")
    name = value.strip() if key.strip() == "scheduler.policy" else ""
    return (
        f"{text} does not apply: simulate runs the policies of --policies (default {default}); "
        f"give --policies {name or 'NAME[,NAME]'}"
    )


def _searched_knobs_set(sched: Any) -> str:
    """The elastic settings of `sched` that differ from their defaults and that the knob search replaces
    (with `elastic_prefetch=paced` the pace set is the one the search tries for paced: it stays)."""
    from gyre_ray.scheduling.config import SchedulerSection

    default = SchedulerSection()
    names = ["elastic_prefetch", "elastic_launch_order", "elastic_duration_prior"]
    if sched.elastic_prefetch != "paced":
        names.insert(1, "elastic_pace_s")
    changed = [f"scheduler.{n}" for n in names if getattr(sched, n) != getattr(default, n)]
    if not changed:
        return ""
    return f"{', '.join(changed)} {'is' if len(changed) == 1 else 'are'}"


def _csv_ints(text: str) -> list[int]:
    try:
        return [int(x) for x in text.split(",") if x.strip()]
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected comma-separated integers, got {text!r}") from None


JOBS_HELP = "processes that simulate elastic's candidate settings at once (default: the CPUs, at most 7)"


def _default_jobs() -> int:
    """The CPUs this process may use, at most the 7 candidate settings elastic tries."""
    return max(1, min(7, len(os.sched_getaffinity(0))))


def register(subparsers: Any) -> None:
    """Add the `simulate` and `plan` sub-commands."""
    sim = subparsers.add_parser(
        "simulate", help="simulate scheduling policies on a workload at cluster scale"
    )
    sim.add_argument(
        "--workload", default=None, help="preset (nl2repo, nl2repo-hard, terminal) or YAML/JSONL/CSV file"
    )
    sim.add_argument("--cells", type=int, default=None, help="cells in the cluster (default sim.cells = 8)")
    sim.add_argument("--steps", type=int, default=None, help="RL steps (default sim.steps = 48)")
    sim.add_argument("--policies", default=None, help="comma-separated, e.g. colocate,async,elastic")
    sim.add_argument(
        "--staleness", type=int, default=None, help="staleness bound eta (default scheduler.staleness)"
    )
    sim.add_argument("--seed", type=int, default=None, help="workload seed (default sim.seed)")
    sim.add_argument(
        "--trace",
        default=None,
        metavar="RUN_DIR",
        help="replay a real run (RUN_DIR/trace.jsonl + costs.json): predicted vs measured makespan",
    )
    sim.add_argument("--json", action="store_true", help="print one JSON object instead of a table")
    sim.add_argument(
        "--plot",
        default=None,
        metavar="FILE",
        help="draw each policy's cell-role timeline to FILE (.png, .pdf or .svg; .png is added to a name "
        "without suffix; FILE's folder must exist)",
    )
    sim.add_argument(
        "--plot-hours", type=float, default=None, help="only the first H hours in the plot (needs --plot)"
    )
    sim.add_argument("--jobs", type=int, default=None, help=JOBS_HELP)
    sim.add_argument("--config", default=None, help="YAML config whose scheduler/sim sections to use")
    sim.add_argument("overrides", nargs="*", help="dotted config overrides, e.g. sim.weight_sync_s=10")
    sim.set_defaults(handler=_simulate_command)

    plan = subparsers.add_parser(
        "plan", help="sweep cluster and cell sizes for a workload; recommend a layout"
    )
    plan.add_argument("--workload", default=None, help="preset or YAML/JSONL/CSV file (default sim.workload)")
    plan.add_argument(
        "--nodes", type=_csv_ints, default=[32], help="cluster size(s) in nodes, e.g. 16,32 (default 32)"
    )
    plan.add_argument(
        "--reference-nodes",
        type=int,
        default=None,
        help="nodes the workload's capacity/training refer to (default: the first --nodes)",
    )
    plan.add_argument(
        "--min-cell-nodes", type=int, default=1, help="nodes one trainer replica needs (default 1)"
    )
    plan.add_argument(
        "--cell-nodes", type=_csv_ints, default=None, help="cell sizes to try (default: divisors)"
    )
    plan.add_argument("--steps", type=int, default=12, help="RL steps per simulation (default 12)")
    plan.add_argument(
        "--staleness", type=int, default=None, help="staleness bound eta (default scheduler.staleness)"
    )
    plan.add_argument("--policy", default="elastic", help="policy to plan for (default elastic)")
    plan.add_argument("--seed", type=int, default=None, help="workload seed (default sim.seed)")
    plan.add_argument("--json", action="store_true", help="print one JSON object instead of a table")
    plan.add_argument("--jobs", type=int, default=None, help=JOBS_HELP)
    plan.add_argument("--config", default=None, help="YAML config whose scheduler/sim sections to use")
    plan.add_argument("overrides", nargs="*", help="dotted config overrides")
    plan.set_defaults(handler=_plan_command)


def _fail(command: str, message: str) -> int:
    print(f"gyre-ray {command}: {message}", file=sys.stderr)
    return 2


def _out_of_range(flag: str, value: int | None, low: int, high: int | None = None) -> str | None:
    """`need FLAG >= LOW, got V` (or `<= HIGH`) when `value` is given and outside the range; else None."""
    if value is not None and value < low:
        return f"need {flag} >= {low}, got {value}"
    if value is not None and high is not None and value > high:
        return f"need {flag} <= {high:,}, got {value:,}"
    return None


def _simulate_command(args: argparse.Namespace) -> int:
    from gyre_ray.config import load_config
    from gyre_ray.sim.engine import SimulationError
    from gyre_ray.sim.runner import costs_from, simulate
    from gyre_ray.sim.workload import WorkloadError, load_workload, sample_workload

    if args.trace is not None:
        return _replay_command(args)
    cfg = load_config(args.config, args.overrides)
    sim, sched = cfg.sim, cfg.scheduler
    cells = args.cells if args.cells is not None else sim.cells
    steps = args.steps if args.steps is not None else sim.steps
    staleness = args.staleness if args.staleness is not None else sched.staleness
    seed = args.seed if args.seed is not None else sim.seed
    jobs = args.jobs if args.jobs is not None else _default_jobs()
    policy_problem = _policy_override_problem(_override_keys(args.overrides), "sim.policies")
    if policy_problem:
        return _fail("simulate", policy_problem)
    policies = _policy_list(args.policies) if args.policies is not None else list(sim.policies)
    if not policies:
        given = f"--policies {args.policies!r}" if args.policies is not None else "sim.policies"
        return _fail("simulate", f"no policy given: {given} names none; give one or more of {POLICY_NAMES}")
    for problem in (
        _out_of_range("--cells", cells, 1, MAX_CELLS),
        _out_of_range("--steps", steps, 1),
        _out_of_range("--staleness", staleness, 0),
        _out_of_range("--seed", seed, 0),
        _out_of_range("--jobs", jobs, 1),
    ):
        if problem:
            return _fail("simulate", problem)
    if "async" in policies and cells < 2:
        return _fail("simulate", "async needs --cells >= 2 (one trainer and one rollout cell)")
    if args.plot_hours is not None and not args.plot:
        return _fail("simulate", "--plot-hours needs --plot FILE")
    if args.plot_hours is not None and not (args.plot_hours > 0 and math.isfinite(args.plot_hours)):
        return _fail("simulate", f"--plot-hours must be > 0 and finite, got {args.plot_hours}")
    if args.plot_hours is not None and args.plot_hours > MAX_PLOT_HOURS:
        return _fail("simulate", f"need --plot-hours <= {MAX_PLOT_HOURS:,.0f}, got {args.plot_hours:g}")
    plot_file = None
    if args.plot:
        from gyre_ray.sim.plot import check_writable, plot_path

        try:
            plot_file = plot_path(args.plot)  # before the simulation, which can take minutes
            check_writable(plot_file)
        except ValueError as exc:
            return _fail("simulate", f"--plot {exc}")
    if sim.tune_knobs and "elastic" in policies:
        searched = _searched_knobs_set(sched)
        if searched:
            print(
                f"gyre-ray simulate: sim.tune_knobs is on, so elastic's knobs are searched and {searched} "
                "not used (sim.tune_knobs=false runs them as set)",
                file=sys.stderr,
            )
    try:
        spec, base_dir = load_workload(args.workload or sim.workload)
        wl = sample_workload(spec, steps, seed, base_dir)
        results = simulate(
            wl,
            policies,
            cells,
            staleness,
            costs_from(sim),
            record=plot_file is not None,
            tune=sim.tune_knobs,
            async_train_cells=sched.async_train_cells,
            repay_factor=sched.elastic_repay_factor,
            prefetch=sched.elastic_prefetch,
            pace_s=sched.elastic_pace_s if sched.elastic_prefetch == "paced" else None,
            progress=_progress_line,
            launch_order=sched.elastic_launch_order,
            prior=sched.duration_prior(),
            jobs=jobs,
        )
    except (WorkloadError, ValueError) as exc:
        return _fail("simulate", str(exc))
    except SimulationError as exc:
        print(f"gyre-ray simulate: simulation failed: {exc}", file=sys.stderr)
        return 1
    report = simulation_report(spec.name, cells, steps, staleness, seed, results)
    if args.json:
        print(json.dumps(report, indent=2))
    else:
        print(format_report(report))
    if plot_file is not None:
        from gyre_ray.sim.plot import plot_timelines

        title = f"{spec.name}: {steps} steps on {cells} cells, eta = {staleness}"
        try:
            path = plot_timelines(
                list(results.values()), plot_file, wl.capacity_per_cell(cells), title, args.plot_hours
            )
        except (OSError, ValueError) as exc:  # the folder went away, a full disk: the table stands
            reason = exc.strerror if isinstance(exc, OSError) and exc.strerror else str(exc).splitlines()[0]
            return _fail("simulate", f"--plot {plot_file}: cannot write the plot ({reason})")
        print(f"wrote {path}", file=sys.stderr if args.json else sys.stdout)
    return 0


def _replay_command(args: argparse.Namespace) -> int:
    from gyre_ray.sim.engine import SimulationError
    from gyre_ray.sim.replay import check_run_dir, format_prediction, predict_run
    from gyre_ray.sim.workload import WorkloadError

    given = (args.workload, args.steps, args.seed, args.plot, args.plot_hours)
    if any(value is not None for value in given):
        return _fail(
            "simulate",
            "--trace replays the run's own workload and steps; drop --workload/--steps/--seed/--plot/--plot-hours",
        )
    for problem in (
        _out_of_range("--cells", args.cells, 1, MAX_CELLS),
        _out_of_range("--staleness", args.staleness, 0),
    ):
        if problem:
            return _fail("simulate", problem)
    keys = _override_keys(args.overrides)
    foreign = sorted({text for key, text in keys.items() if key.split(".")[0] != "scheduler"})
    if foreign:
        return _fail(
            "simulate",
            f"--trace takes the workload, steps and costs from the run: {', '.join(foreign)} does not apply "
            "(a replay takes scheduler.* overrides, --cells, --staleness and --policies)",
        )
    policy_problem = _policy_override_problem(keys, "the run's own")
    if policy_problem:
        return _fail("simulate", policy_problem)
    policies = None
    if args.policies is not None:
        policies = _policy_list(args.policies)
        if not policies:
            return _fail(
                "simulate",
                f"no policy given: --policies {args.policies!r} names none; give one or more of "
                f"{POLICY_NAMES} (or leave --policies out to replay the run's own)",
            )
        if "async" in policies and args.cells is not None and args.cells < 2:
            return _fail("simulate", "async needs --cells >= 2 (one trainer and one rollout cell)")
    run_dir = Path(args.trace)
    if run_dir.is_file():
        return _fail(
            "simulate",
            f"--trace {run_dir} is a file; give the run folder that holds it (--workload FILE replays a bare trace)",
        )
    try:
        check_run_dir(run_dir)
        scheduler = _replay_scheduler(run_dir, args.config, args.overrides)
        # scheduler.staleness=N given as an override acts as --staleness N (which wins when both are given)
        staleness = args.staleness
        if staleness is None and "scheduler.staleness" in keys:
            staleness = scheduler.staleness
        report = predict_run(
            run_dir, args.cells, staleness, policies, scheduler.async_train_cells or None, scheduler
        )
    except (WorkloadError, ValueError) as exc:
        return _fail("simulate", str(exc))
    except SimulationError as exc:
        print(f"gyre-ray simulate: simulation failed: {exc}", file=sys.stderr)
        return 1
    print(json.dumps(report, indent=2) if args.json else format_prediction(report))
    return 0


def _replay_scheduler(run_dir: Path, config: str | None, overrides: list[str]) -> SchedulerSection:
    """The scheduler section a replay simulates: `--config`'s when given, else the run's own
    (`run_scheduler_section`), with the overrides on top."""
    from gyre_ray.config import apply_overrides, load_config, validate_config
    from gyre_ray.sim.replay import CONFIG_FILE, run_scheduler_section

    if config is not None:
        return load_config(config, overrides).scheduler
    data = apply_overrides({"scheduler": run_scheduler_section(run_dir).model_dump(mode="json")}, overrides)
    return validate_config(data, f"{run_dir / CONFIG_FILE} + overrides").scheduler


def simulation_report(
    workload: str, cells: int, steps: int, staleness: int, seed: int, results: dict[str, Any]
) -> dict[str, Any]:
    """The `--json` object: run settings, one summary per policy, and speedups of elastic."""
    report: dict[str, Any] = {
        "workload": workload,
        "cells": cells,
        "steps": steps,
        "staleness": staleness,
        "seed": seed,
        "policies": {name: r.summary() for name, r in results.items()},
    }
    if "elastic" in results:
        elastic = results["elastic"].makespan_s
        report["speedups"] = {  # None: elastic took no time (a workload with nothing to do)
            f"elastic_vs_{name}": round(r.makespan_s / elastic, 4) if elastic > 0 else None
            for name, r in results.items()
            if name != "elastic"
        }
    return report


def _ratio_text(value: float | None, width: int = 7) -> str:
    """`value` as `1.234` in `width` columns; `-` where it is None (a zero denominator: no work)."""
    return f"{value:{width}.3f}" if value is not None else f"{'-':>{width}s}"


def format_report(report: dict[str, Any]) -> str:
    """A plain-text table of a simulation report."""
    steps = report["steps"]
    lines = [
        f"workload {report['workload']}: {steps} steps on {report['cells']} cells, staleness bound eta = "
        f"{report['staleness']}, seed {report['seed']}",
        f"{'policy':10s} {'makespan h':>10s} {'h/step':>7s} {'bound h':>8s} {'x bound':>7s} "
        f"{'util':>6s} {'stale':>6s} {'switches':>8s}  knobs",
    ]
    for name, row in report["policies"].items():
        knobs = {k: v for k, v in row["knobs"].items() if k not in ("sweep_makespan_s", "duration_prior")}
        lines.append(
            f"{name:10s} {row['makespan_s'] / HOUR:10.2f} {row['makespan_s'] / HOUR / steps:7.3f} "
            f"{row['lower_bound_s'] / HOUR:8.2f} {_ratio_text(row['ratio_to_bound'])} {row['utilization']:6.1%} "
            f"{row['mean_staleness']:6.2f} {row['switches']:8d}  {knobs or ''}"
        )
    for key, value in report.get("speedups", {}).items():
        lines.append(f"{key.replace('_', ' ')}: {'-' if value is None else f'{value:.3f}x'}")
    return "\n".join(lines)


def _progress_line(message: str) -> None:
    """`simulate` reports each finished policy (and elastic candidate) on stderr: runs can take minutes."""
    print(f"gyre-ray simulate: {message}", file=sys.stderr, flush=True)


def _plan_progress(message: str) -> None:
    """`plan` reports each simulated layout on stderr (the defaults take over a minute); stdout stays clean."""
    print(f"gyre-ray plan: {message}", file=sys.stderr, flush=True)


def _plan_command(args: argparse.Namespace) -> int:
    from gyre_ray.config import load_config
    from gyre_ray.sim.engine import SimulationError
    from gyre_ray.sim.plan import plan_layouts, recommend
    from gyre_ray.sim.runner import costs_from
    from gyre_ray.sim.workload import WorkloadError, load_workload

    cfg = load_config(args.config, args.overrides)
    staleness = args.staleness if args.staleness is not None else cfg.scheduler.staleness
    seed = args.seed if args.seed is not None else cfg.sim.seed
    if not args.nodes or min(args.nodes) < 2 or max(args.nodes) > MAX_CELLS:
        return _fail("plan", f"--nodes must list cluster sizes from 2 to {MAX_CELLS:,}, got {args.nodes}")
    if args.cell_nodes is not None and (not args.cell_nodes or min(args.cell_nodes) < 1):
        return _fail("plan", f"--cell-nodes must list cell sizes >= 1 node, got {args.cell_nodes}")
    for flag, value in (
        ("--reference-nodes", args.reference_nodes),
        ("--min-cell-nodes", args.min_cell_nodes),
        ("--steps", args.steps),
        ("--jobs", args.jobs),
    ):
        if value is not None and value < 1:
            return _fail("plan", f"{flag} must be >= 1, got {value}")
    for flag, value in (("--staleness", staleness), ("--seed", seed)):
        if value < 0:
            return _fail("plan", f"{flag} must be >= 0, got {value}")
    if not args.policy.strip():
        return _fail("plan", f"--policy is empty; give one of {POLICY_NAMES}")
    reference = args.reference_nodes if args.reference_nodes is not None else args.nodes[0]
    jobs = args.jobs if args.jobs is not None else _default_jobs()
    try:
        spec, base_dir = load_workload(args.workload or cfg.sim.workload)
        layouts = plan_layouts(
            spec,
            args.nodes,
            reference,
            args.min_cell_nodes,
            args.cell_nodes,
            args.steps,
            staleness,
            args.policy,
            seed,
            costs_from(cfg.sim),
            progress=_plan_progress,
            base_dir=base_dir,
            jobs=jobs,
        )
        picks = {n: recommend(layouts, n) for n in args.nodes}
    except (WorkloadError, ValueError) as exc:
        return _fail("plan", str(exc))
    except SimulationError as exc:
        print(f"gyre-ray plan: simulation failed: {exc}", file=sys.stderr)
        return 1
    if args.json:
        print(
            json.dumps(
                {
                    "workload": spec.name,
                    "policy": args.policy,
                    "steps": args.steps,
                    "staleness": staleness,
                    "layouts": [{**vars(x), "node_hours": round(x.node_hours, 2)} for x in layouts],
                    "recommended": {str(n): vars(x) for n, x in picks.items()},
                },
                indent=2,
            )
        )
        return 0
    print(f"workload {spec.name}: {args.policy}, {args.steps} steps, eta = {staleness}")
    print(
        f"{'nodes':>5s} {'cell nodes':>10s} {'cells':>5s} {'h/step':>7s} {'x bound':>7s} {'util':>6s} {'node-h':>8s}"
    )
    for x in sorted(layouts, key=lambda x: (x.nodes, x.cell_nodes)):
        print(
            f"{x.nodes:5d} {x.cell_nodes:10d} {x.cells:5d} {x.makespan_s / HOUR / args.steps:7.3f} "
            f"{_ratio_text(x.makespan_s / x.lower_bound_s if x.lower_bound_s > 0 else None)} "
            f"{x.utilization:6.1%} {x.node_hours:8.1f}"
        )
    for n, x in picks.items():
        print(
            f"recommended for {n} nodes: {x.cells} cells of {x.cell_nodes} node{'s' if x.cell_nodes != 1 else ''} "
            f"({x.makespan_s / HOUR / args.steps:.3f} h per step)"
        )
    return 0
