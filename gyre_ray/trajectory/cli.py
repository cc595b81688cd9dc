"""`gyre-ray traj show RECORDS [--budget N] [--json]`: an execution's call tree in the terminal.

Shows each execution's prefix tree (token and loss-token counts per node, the calls that end there
with their roles) and, at every leaf, the path's role and whether the budget keeps it. `--json`
prints the token figures (summed over executions at the top level, per execution under
`executions`): paths_total, paths_selected, tokens_expanded_all, tokens_packed_all,
tokens_expanded_selected, tokens_packed_selected, loss_tokens_selected and more.
RECORDS is a JSONL file of call records or a folder of them, one `<execution_id>.jsonl` per
execution (a run's `records/`): `--execution ID` shows that execution's file; without it a folder
gets one line per execution (calls, tokens), or with `--json` the figures of all of them. A run folder
(or a `gyre-ray eval` output folder) given for RECORDS is read through its `records/`.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path
from typing import Any

from gyre_ray.run_folder import job_files


def register(subparsers: argparse._SubParsersAction) -> None:
    traj = subparsers.add_parser("traj", help="inspect recorded trajectories (call trees)")
    actions = traj.add_subparsers(dest="traj_command", metavar="ACTION")
    show = actions.add_parser("show", help="show each execution's call tree and which paths are trained on")
    show.add_argument(
        "records", help="JSONL file of call records (one per line), or a folder of them (a run's records/)"
    )
    show.add_argument("--budget", type=int, default=None, help="paths kept per execution (default: config)")
    show.add_argument(
        "--tie-break", choices=("longest", "latest", "earliest"), default=None, help="order within a role"
    )
    show.add_argument("--execution", default=None, help="only this execution id")
    show.add_argument("--vocab-size", type=int, default=None, help="reject token ids >= this")
    show.add_argument("--json", action="store_true", help="print token figures as JSON")
    show.set_defaults(handler=_show)
    traj.set_defaults(handler=lambda args: _usage(traj))


def _usage(parser: argparse.ArgumentParser) -> int:
    parser.print_help()
    return 2


def _path_rows(processed: Any) -> list[dict[str, Any]]:
    rank = {id(p): r for r, p in enumerate(processed.selected, start=1)}
    return [
        {
            "path": p.index,
            "role": p.role,
            "tokens": p.num_tokens,
            "loss_tokens": p.num_loss_tokens,
            "calls": [processed.tree.calls[c].call_id for c in p.calls],
            "selected": id(p) in rank,
            "rank": rank.get(id(p)),
        }
        for p in processed.paths
    ]


def render_tree(processed: Any) -> str:
    """The tree as indented text: one line per node, leaves annotated with their path."""
    tree, roles = processed.tree, processed.roles
    rows = {row["path"]: row for row in _path_rows(processed)}
    leaf_path = {p.leaf.id: p.index for p in processed.paths}
    ends: dict[int, list[int]] = {}
    for call, (node, _) in tree.call_ends().items():
        ends.setdefault(node.id, []).append(call)
    lines: list[str] = []

    def visit(node: Any, prefix: str, last: bool) -> None:
        label = f"{len(node.tokens)} tok, {sum(node.loss)} loss"
        calls = sorted(ends.get(node.id, []))
        if calls:
            label += "  calls " + " ".join(f"{tree.calls[c].call_id}({roles[c]})" for c in calls)
        if node.id in leaf_path:
            row = rows[leaf_path[node.id]]
            mark = f"selected #{row['rank']}" if row["selected"] else "dropped"
            label += f"  => path {row['path']} {row['role']}, {row['tokens']} tok, {row['loss_tokens']} loss [{mark}]"
        lines.append(f"{prefix}{'└── ' if last else '├── '}{label}")
        kids = sorted(node.children.values(), key=lambda n: n.id)
        for k, child in enumerate(kids):
            visit(child, prefix + ("    " if last else "│   "), k == len(kids) - 1)

    tops = sorted(tree.root.children.values(), key=lambda n: n.id)
    for k, top in enumerate(tops):
        visit(top, "", k == len(tops) - 1)
    return "\n".join(lines)


def record_files(folder: Path) -> list[Path]:
    """The call-record files of a records folder, by name (not the store's `.registry.jsonl`)."""
    return sorted(p for p in folder.glob("*.jsonl") if p.is_file() and not p.name.startswith("."))


def list_executions(folder: Path, executions: dict[str, list[Any]]) -> str:
    """One line per execution of a records folder, by its first model call: its id, calls and tokens (prompt +
    output of every call, as `trace.jsonl` counts them)."""
    width = max(len("execution"), *map(len, executions))
    lines = [
        f"{folder}: {len(executions)} executions; show one with --execution ID",
        f"{'execution':{width}s} {'calls':>6s} {'tokens':>9s}",
    ]
    launched = sorted(executions.items(), key=lambda item: (min(r.t_start for r in item[1]), item[0]))
    for execution_id, records in launched:
        tokens = sum(len(r.input_ids) + len(r.output_ids) for r in records)
        lines.append(f"{execution_id:{width}s} {len(records):6d} {tokens:9d}")
    return "\n".join(lines)


def _run_trajectory(run_json: dict) -> Any:
    """The run's `trajectory` section (the defaults when there is no run or it does not validate)."""
    from gyre_ray.trajectory.config import TrajectorySection

    try:
        return TrajectorySection.model_validate(run_json.get("trajectory") or {})
    except ValueError:
        return TrajectorySection()


def _run_decoder(run_json: dict) -> Any:
    """The run's tokenizer's decode, which training gives the role classifier and the re-encoding
    check (None without a run, or where its model's tokenizer does not load here)."""
    if "model" not in run_json:
        return None
    from gyre_ray.runtime.groups import model_decoder

    try:
        return model_decoder(run_json["model"])[0]
    except Exception:  # noqa: BLE001 - a model folder of another machine: shown without text checks
        return None


def _fail(message: str) -> int:
    print(f"gyre-ray traj show: {message}", file=sys.stderr)
    return 2


def _show(args: argparse.Namespace) -> int:
    from gyre_ray.proxy.store_files import json_object
    from gyre_ray.trajectory.pipeline import TOKEN_FIGURES, process_execution
    from gyre_ray.trajectory.records import RecordError, group_by_execution, read_jsonl

    if args.budget is not None and args.budget < 1:
        return _fail(f"--budget must be an integer >= 1, got {args.budget}")
    given = Path(args.records)  # a records file, or a folder of them
    run_json: dict = {}
    if given.is_dir() and (run_files := job_files(given)):  # a run folder, not its records/
        if not (given / "records").is_dir():
            return _fail(
                f"{given} is a run folder ({', '.join(run_files)}) with no records/ folder: give the "
                "folder of call records (proxy.records_dir) or one <execution_id>.jsonl"
            )
        run_json = json_object(given / "config.json", {})  # (empty when it does not read)
        given = given / "records"  # what it meant (error messages and the listing name it)
    flags = {"budget": args.budget, "tie_break": args.tie_break}  # (both checked above / by argparse)
    # a run folder: its own settings, as training used them; the flags given win
    cfg = _run_trajectory(run_json).model_copy(update={k: v for k, v in flags.items() if v is not None})
    sources = [given]
    if given.is_dir():
        files = record_files(given)
        if not files:
            return _fail(f"{given} holds no record files (<execution_id>.jsonl)")
        sources = files
        if args.execution is not None:
            sources = [f for f in files if f.stem == args.execution]
            if not sources:
                return _fail(
                    f"no execution {args.execution!r} in {given} ({len(files)} record files; "
                    f"`gyre-ray traj show {given}` lists them)"
                )
    try:
        executions = group_by_execution(r for path in sources for r in read_jsonl(path, args.vocab_size))
    except OSError as exc:
        return _fail(f"cannot read {exc.filename or given}: {exc.strerror}")
    except RecordError as exc:
        return _fail(str(exc))
    if not executions:
        return _fail(f"{given} holds no call records")
    if given.is_dir() and args.execution is None and not args.json:
        print(list_executions(given, executions))
        return 0
    if args.execution is not None:
        if args.execution not in executions:
            return _fail(f"no execution {args.execution!r} (have: {', '.join(sorted(executions))})")
        executions = {args.execution: executions[args.execution]}
    decode = _run_decoder(run_json)  # (loads the tokenizer: not for a listing)
    try:  # records that are each valid may still contradict each other (e.g. a repeated call_id)
        processed = [process_execution(records, cfg, decode=decode) for records in executions.values()]
    except RecordError as exc:
        return _fail(f"{given}: {exc}")
    if args.json:
        per_execution = [{**p.stats(), "paths": _path_rows(p)} for p in processed]
        totals = {k: sum(e[k] for e in per_execution) for k in ("calls", *TOKEN_FIGURES, "drift_remapped")}
        print(json.dumps({**totals, "budget": cfg.budget, "executions": per_execution}, indent=2))
        return 0
    for p in processed:
        s = p.stats()
        roles = ", ".join(f"{r} {n}" for r, n in s["call_roles"].items())
        print(
            f"execution {s['execution_id']}: {s['calls']} calls ({roles}); "
            f"{s['paths_selected']} of {s['paths_total']} paths selected (budget {cfg.budget})"
        )
        print(
            f"  tokens: expanded all {s['tokens_expanded_all']}, packed all {s['tokens_packed_all']}, "
            f"expanded selected {s['tokens_expanded_selected']}, packed selected {s['tokens_packed_selected']}, "
            f"loss selected {s['loss_tokens_selected']}"
        )
        print(render_tree(p))
    return 0
