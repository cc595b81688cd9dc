"""`gyre-ray eval`: the run's evaluation from the shell, on a run's newest checkpoint or any model folder.

    gyre-ray eval --run RUN_DIR [overrides]                 # the run's config, held-out split and checkpoint
    gyre-ray eval --model-dir DIR [--config C] [--task-set S] [overrides]

It starts rollout-only cells serving the policy (`model.path` = the checkpoint's HF folder), the proxy
and the warm `workers` actor, runs one evaluation round exactly as `run.eval_every` does during
training (`gyre_ray.evaluation`: the held-out tasks, `run.eval_samples` executions each, the same fixed
seeds), prints it, and writes the round as JSON (`--json`, default `<out>/eval.json`) and under
`<out>/` its eval.jsonl, call records and workspaces. `<out>` is `RUN_DIR/evals/<time>` for a run,
else `<run.run_dir>/eval-<time>`. `--run` takes the newest checkpoint that loads, as `train --resume`
does (a damaged newer one is skipped with a warning on stderr); a run folder given to `--model-dir`
and a `model.path` set beside either source (an override, or the `--config` file) are refused with one
line. A `proxy.records_dir` given so puts the round's call records there instead of `<out>/records`.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path
from typing import Any

from gyre_ray.config import GyreConfig, load_config


def register(subparsers: argparse._SubParsersAction) -> None:
    parser = subparsers.add_parser(
        "eval", help="evaluate a run's checkpoint or a model folder on held-out tasks"
    )
    source = parser.add_mutually_exclusive_group(required=True)
    source.add_argument("--run", metavar="RUN_DIR", help="a run folder: its config and newest checkpoint")
    source.add_argument(
        "--model-dir", "--checkpoint", dest="model_dir", metavar="DIR", help="an HF model folder"
    )
    parser.add_argument(
        "--config", default=None, help="YAML config for --model-dir (default: built-in defaults)"
    )
    parser.add_argument("--task-set", default=None, help="evaluate on this task set (sets run.eval_task_set)")
    parser.add_argument("--out", default=None, help="folder for the round's records and workspaces")
    parser.add_argument(
        "--json", default=None, help="write the result here ('-' = stdout; default <out>/eval.json)"
    )
    parser.add_argument("overrides", nargs="*", help="dotted overrides, e.g. run.eval_samples=4")
    parser.set_defaults(handler=_eval_command)


def _eval_command(args: argparse.Namespace) -> int:
    from gyre_ray.checkpoint import CheckpointError, newest_good, trainer_dir
    from gyre_ray.cli_inputs import given_setting, refuse_model_path_clash, run_folder_hint, warn_on_stderr
    from gyre_ray.config import ConfigError
    from gyre_ray.model.checkpoint import check_hf_folder
    from gyre_ray.train import resume_config, runs_root

    stamp = time.strftime("%Y%m%d-%H%M%S")
    overrides = list(args.overrides) + ([f"run.eval_task_set={args.task_set}"] if args.task_set else [])
    given = f"--run {args.run}" if args.run else f"--model-dir {args.model_dir}"
    if args.run and args.config:
        raise ConfigError("--run uses the run folder's config.json; give overrides, not --config")
    refuse_model_path_clash(given, args.overrides, args.config)
    if args.run:
        cfg = resume_config(args.run, overrides)
        try:
            saved, step = newest_good(args.run, warn=warn_on_stderr)
        except CheckpointError as exc:
            raise ConfigError(f"cannot evaluate {args.run}: {exc}") from None
        model_dir = trainer_dir(saved)
        out = Path(args.out or Path(args.run) / "evals" / stamp)
    else:
        cfg = load_config(args.config, overrides)
        model_dir, step = Path(args.model_dir), 0
        if hint := run_folder_hint(model_dir):
            raise ConfigError(f"--model-dir {hint}")
        if not (model_dir / "config.json").is_file():
            raise ConfigError(f"--model-dir {model_dir}: no config.json (not an HF model folder)")
        out = Path(args.out or runs_root(cfg.run.run_dir) / f"eval-{stamp}")
    _check_outputs(out, args.json)  # before the round, which takes a while
    from gyre_ray.agents.harnesses import check_harness_here

    check_harness_here(cfg.agents)
    try:
        check_hf_folder(model_dir)
    except (OSError, ValueError) as exc:
        raise ConfigError(f"cannot load the model: {exc}") from None
    if not given_setting("proxy", "records_dir", args.overrides, args.config):  # else the one given
        cfg = cfg.model_copy(
            update={"proxy": cfg.proxy.model_copy(update={"records_dir": str(out.resolve() / "records")})}
        )
    row = evaluate(cfg, model_dir, out, step)
    text = json.dumps(row, indent=2)
    if args.json == "-":
        print(text)
    else:
        target = Path(args.json or out / "eval.json")
        target.write_text(text + "\n")
        print(f"gyre-ray eval: {target}")
    from gyre_ray.evaluation import format_eval

    print(f"gyre-ray eval: {format_eval(row)}", file=sys.stderr if args.json == "-" else sys.stdout)
    return 0


def _check_outputs(out: Path, json_path: str | None) -> None:
    """Refuse output paths the round could not write, before it runs."""
    from gyre_ray.config import ConfigError

    if out.exists() and not out.is_dir():
        raise ConfigError(f"--out {out} is a file; give a folder (created if missing)")
    if json_path not in (None, "-"):
        target = Path(json_path)
        if target.is_dir():
            raise ConfigError(f"--json {target} is a folder; give a file path")
        if not target.parent.is_dir():
            raise ConfigError(f"--json {target}: its folder {target.parent} does not exist")


def evaluate(
    cfg: GyreConfig, model_dir: str | Path, out: str | Path, step: int = 0, execute: Any = None
) -> dict[str, Any]:
    """One evaluation round of the policy in `model_dir` (after `step` updates); returns its row. Its
    executions' workspaces go under `out`, their call records to `cfg.proxy.records_dir` (the command
    sets `<out>/records` there unless told another folder)."""
    from gyre_ray.evaluation import EvalRunner, split_tasks
    from gyre_ray.runtime.cluster import Runtime

    run = cfg.run.model_copy(update={"eval_every": cfg.run.eval_every or 1})  # a held-out split either way
    cfg = cfg.model_copy(
        update={"run": run, "model": cfg.model.model_copy(update={"path": str(Path(model_dir).resolve())})}
    )
    split_tasks(cfg)  # a held-out split that cannot be made fails here, before Ray starts
    out = Path(out).resolve()
    out.mkdir(parents=True, exist_ok=True)
    runtime = Runtime.start(cfg, dual_role=False, app_name="gyre-eval")
    try:
        # the runners where set: the agents' nodes, as in training
        executors, base_url = runtime.start_executors()
        runner = EvalRunner(
            cfg, runtime.store, executors, base_url, out, execute, proxy=runtime.proxy_admin()
        )
        runner.start(step, step)
        rows = runner.finish(
            step, timeout_s=cfg.agents.timeout_s * cfg.run.eval_samples * len(runner.tasks) + 600
        )
        if not rows:
            raise TimeoutError("the evaluation round did not end in time")
    finally:
        runtime.shutdown()  # (its workers and runners too)
    return rows[0]
