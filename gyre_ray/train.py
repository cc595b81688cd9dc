"""The training job: `gyre-ray train --config jobs/configs/toy.yaml [overrides]`.

It builds dual-role cells (cell 0 is the core: authoritative weights and optimizer state), the
proxy in front of them, and runs RL steps. In each step the scheduler policy (`scheduler.policy`:
elastic, colocate or async, the same objects the simulator drives) launches a group of executions
per task through the proxy, moves cells between rollout and training while agents keep running,
and trainers claim the micro-batches of each finished group (records -> prefix trees -> budgeted,
packed samples with group-normalised advantages). The core sums the gradients, steps once (scaled
by the number of executions) and every cell rolls out the new version. Everything lands in a run
folder: config, call records, metrics, summary, workspaces and the core's checkpoint.
"""

from __future__ import annotations

import argparse
import json
import os
import time
from pathlib import Path
from typing import Any

from gyre_ray.config import GyreConfig, load_config


def register(subparsers: argparse._SubParsersAction) -> None:
    parser = subparsers.add_parser(
        "train", help="run the RL training job (local Ray, or the cluster under ray job submit)"
    )
    parser.add_argument("--config", default=None, help="YAML config (default: built-in defaults)")
    parser.add_argument("overrides", nargs="*", help="dotted overrides, e.g. trainer.lr=1e-5 run.steps=2")
    parser.set_defaults(handler=_train_command)


def _train_command(args: argparse.Namespace) -> int:
    summary = train(load_config(args.config, args.overrides))
    print(format_summary(summary))
    return 0


def new_run_dir(cfg: GyreConfig) -> Path:
    stamp = time.strftime("%Y%m%d-%H%M%S")
    run_dir = Path(cfg.run.run_dir).resolve() / f"{cfg.run.name}-{stamp}-{os.getpid()}"
    run_dir.mkdir(parents=True, exist_ok=False)
    (run_dir / "config.json").write_text(cfg.model_dump_json(indent=2))
    return run_dir


def connect_ray(cfg: GyreConfig) -> None:
    """Join the cluster under `ray job submit` (RAY_ADDRESS is set), else start a private local Ray."""
    import logging

    import ray

    from gyre_ray.proxy.launch import local_ray_cpus

    logging.getLogger("ray.serve").setLevel(logging.WARNING)  # the job prints its own progress
    if os.environ.get("RAY_ADDRESS"):
        ray.init(logging_level="WARNING")
    else:
        ray.init(
            address="local",
            num_cpus=local_ray_cpus(cfg.proxy),
            include_dashboard=False,
            logging_level="WARNING",
        )


def train(cfg: GyreConfig) -> dict[str, Any]:
    """Run `cfg.run.steps` RL steps end to end and return the run summary (also saved as summary.json)."""
    import ray

    from gyre_ray.agents.launch import plan_step
    from gyre_ray.elastic.launch import start_elastic_proxy
    from gyre_ray.elastic.step import cell_actors, run_elastic_step
    from gyre_ray.envs.base import get_task_set
    from gyre_ray.model import load_tokenizer_and_args
    from gyre_ray.observability.metrics import MetricsLogger
    from gyre_ray.scheduling.runtime import Costs

    run_dir = new_run_dir(cfg)
    cfg = cfg.model_copy(
        update={"proxy": cfg.proxy.model_copy(update={"records_dir": str(run_dir / "records")})}
    )
    print(f"gyre-ray: run folder {run_dir}", flush=True)
    tokenizer, args = load_tokenizer_and_args(cfg.model)
    tasks = get_task_set(cfg.agents.task_set)
    connect_ray(cfg)
    proxy = start_elastic_proxy(cfg)
    print(
        f"gyre-ray: proxy at {proxy.base_url}; {len(proxy.cell_ids)} dual-role cells "
        f"({proxy.cell_ids[0]} is the core); scheduler policy {cfg.scheduler.policy}",
        flush=True,
    )
    logger = MetricsLogger(run_dir, run_dir.name, json.loads(cfg.model_dump_json()), cfg.run.wandb_mode)
    steps: list[dict[str, Any]] = []
    costs: Costs | None = None
    try:
        for step in range(cfg.run.steps):
            planned = plan_step(step, tasks, cfg.run.tasks_per_step, cfg.algo.group_size)
            metrics = run_elastic_step(
                proxy,
                planned,
                cfg,
                run_dir / "workspaces",
                decode=tokenizer.decode,
                vocab_size=args.vocab_size,
                costs=costs,
            )
            costs = Costs(**metrics["costs"])  # measured switch and micro-step costs inform the next step
            logger.log(step, metrics)
            steps.append(metrics)
            print(f"gyre-ray: step {step}: {format_step(metrics)}", flush=True)
        core = cell_actors(proxy)[proxy.cell_ids[0]]
        checkpoint = ray.get(core.save.remote(str(run_dir / "checkpoint")), timeout=600)
    finally:
        logger.close()
        proxy.shutdown()
        ray.shutdown()
    summary = {"run_dir": str(run_dir), "checkpoint": str(checkpoint), "steps": steps}
    (run_dir / "summary.json").write_text(json.dumps(summary, indent=2))
    return summary


def format_step(m: dict[str, Any]) -> str:
    text = (
        f"{m['valid']}/{m['executions']} executions scored (timeouts {m['timed_out']}), "
        f"reward {m['reward_mean']:.3f}, {m['calls']} model calls, paths {m['paths_selected']}/{m['paths_total']} kept, "
        f"tokens {m['tokens_expanded_all']} expanded -> {m['tokens_packed_selected']} packed, "
        f"{m['loss_tokens']} loss tokens"
    )
    if "loss" in m:
        text += f", loss {m['loss']:.4g}, grad norm {m['grad_norm']:.4g}"
        if "logprob_gap_max" in m:
            text += f", engine/trainer logprob gap {m['logprob_gap_max']:.2e}"
        trained = ", ".join(f"{cell} {n}" for cell, n in sorted(m.get("trained_by_cell", {}).items()))
        text += f", micro-batches trained by cell: {trained}, weights v{m['version']}"
    switches = m.get("switches", [])
    if switches:
        text += f"; {len(switches)} role switches"
    return text


def format_summary(summary: dict[str, Any]) -> str:
    lines = [f"gyre-ray train: {len(summary['steps'])} step(s) done"]
    lines += [f"  step {i}: {format_step(m)}" for i, m in enumerate(summary["steps"])]
    run_dir = summary["run_dir"]
    lines.append(f"  run folder: {run_dir} (records/, metrics.jsonl, summary.json, workspaces/)")
    lines.append(f"  checkpoint: {summary['checkpoint']} (HF folder + optimizer state)")
    return "\n".join(lines)
