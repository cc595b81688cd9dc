"""The training job: `gyre-ray train --config jobs/configs/toy.yaml [overrides]`.

One RL step reads like the algorithm: launch a group of executions per task through the proxy,
score their workspaces, turn each execution's recorded calls into a budgeted prefix-tree sample
with group-normalised advantages, accumulate GSPO gradients over the micro-batches, step the
optimizer once (scaled by the number of executions) and publish the new weights to the rollout
cells. Everything lands in a run folder: config, call records, metrics, summary and checkpoint.

This driver runs the on-policy (colocate-like) loop; the elastic scheduler drives the same pieces.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
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


def connect_ray() -> None:
    """Join the cluster under `ray job submit` (RAY_ADDRESS is set), else start a private local Ray."""
    import ray

    if os.environ.get("RAY_ADDRESS"):
        ray.init(logging_level="WARNING")
    else:
        ray.init(
            address="local",
            num_cpus=max(2, os.cpu_count() or 2),
            include_dashboard=False,
            logging_level="WARNING",
        )


def train(cfg: GyreConfig) -> dict[str, Any]:
    """Run `cfg.run.steps` RL steps end to end and return the run summary (also saved as summary.json)."""
    import ray

    from gyre_ray.agents.launch import plan_step, run_step_executions
    from gyre_ray.algo import get_loss
    from gyre_ray.envs.base import get_task_set
    from gyre_ray.model import load_policy
    from gyre_ray.observability.metrics import MetricsLogger
    from gyre_ray.proxy.launch import start_proxy
    from gyre_ray.trainers.factory import make_trainer

    run_dir = new_run_dir(cfg)
    cfg = cfg.model_copy(
        update={"proxy": cfg.proxy.model_copy(update={"records_dir": str(run_dir / "records")})}
    )
    print(f"gyre-ray: run folder {run_dir}", flush=True)
    connect_ray()
    proxy = start_proxy(cfg)
    print(f"gyre-ray: proxy at {proxy.base_url} with {len(proxy.cell_ids)} rollout cells", flush=True)
    model, tokenizer, args = load_policy(cfg.model)
    trainer = make_trainer(cfg.trainer, model, args, get_loss(cfg.algo.name, cfg.algo))
    logger = MetricsLogger(run_dir, run_dir.name, json.loads(cfg.model_dump_json()), cfg.run.wandb_mode)
    tasks = get_task_set(cfg.agents.task_set)
    steps: list[dict[str, Any]] = []
    try:
        for step in range(cfg.run.steps):
            planned = plan_step(step, tasks, cfg.run.tasks_per_step, cfg.algo.group_size)
            outcomes = run_step_executions(proxy, planned, cfg.agents, run_dir / "workspaces")
            groups = {p.execution_id: p.group for p in planned}
            metrics = train_on_outcomes(proxy, trainer, outcomes, groups, cfg, tokenizer.decode)
            proxy.update_weights(trainer.state_dict(), trainer.version)
            logger.log(step, metrics)
            steps.append(metrics)
            print(f"gyre-ray: step {step}: {format_step(metrics)}", flush=True)
        checkpoint = trainer.save(run_dir / "checkpoint")
    finally:
        logger.close()
        proxy.shutdown()
        ray.shutdown()
    summary = {"run_dir": str(run_dir), "checkpoint": str(checkpoint), "steps": steps}
    (run_dir / "summary.json").write_text(json.dumps(summary, indent=2))
    return summary


def train_on_outcomes(
    proxy: Any, trainer: Any, outcomes: list[Any], groups: dict[str, str], cfg: GyreConfig, decode: Any
) -> dict[str, Any]:
    """Records -> trees -> micro-batches -> one optimizer step; returns the step's metrics."""
    from gyre_ray.algo.gspo import step_scale
    from gyre_ray.trajectory.pipeline import build_training_batches, process_execution

    valid = [o for o in outcomes if o.valid]
    records = {o.execution_id: proxy.records(o.execution_id) for o in valid}
    for outcome in outcomes:
        proxy.finish_execution(outcome.execution_id)
    rewards = {o.execution_id: o.reward for o in valid}
    vocab = trainer.args.vocab_size
    trees = [process_execution(r, cfg.trajectory, decode, vocab).stats() for r in records.values() if r]
    batches = build_training_batches(records, rewards, groups, cfg, decode=decode, vocab_size=vocab)
    metrics: dict[str, Any] = {
        "executions": len(outcomes),
        "valid": len(valid),
        "timed_out": sum(o.timed_out for o in outcomes),
        "reward_mean": statistics.fmean(rewards.values()) if rewards else 0.0,
        "calls": sum(t["calls"] for t in trees),
        "paths_total": sum(t["paths_total"] for t in trees),
        "paths_selected": sum(t["paths_selected"] for t in trees),
        "tokens_expanded_all": sum(t["tokens_expanded_all"] for t in trees),
        "tokens_packed_selected": sum(t["tokens_packed_selected"] for t in trees),
        "loss_tokens": sum(t["loss_tokens_selected"] for t in trees),
        "micro_batches": len(batches),
    }
    if not batches:
        metrics["skipped"] = "no executions with model-generated tokens"
        return metrics
    metrics["logprob_mismatch_max"] = max(_logprob_mismatch(trainer, b) for b in batches)
    losses = [trainer.forward_backward(b)["loss"] for b in batches]
    step_metrics = trainer.optimizer_step(step_scale(batches))
    metrics.update(loss=sum(losses), grad_norm=step_metrics.get("grad_norm"), version=trainer.version)
    return metrics


def _logprob_mismatch(trainer: Any, batch: Any) -> float:
    """Largest |engine logprob - trainer logprob| over the batch's loss tokens (0 = no mismatch)."""
    mask = batch.tensors["loss_mask"]
    diff = (trainer.compute_logprobs(batch) - batch.tensors["old_logprobs"]).abs()
    return float(diff[mask].max()) if bool(mask.any()) else 0.0


def format_step(m: dict[str, Any]) -> str:
    text = (
        f"{m['valid']}/{m['executions']} executions scored (timeouts {m['timed_out']}), "
        f"reward {m['reward_mean']:.3f}, {m['calls']} model calls, paths {m['paths_selected']}/{m['paths_total']} kept, "
        f"tokens {m['tokens_expanded_all']} expanded -> {m['tokens_packed_selected']} packed, "
        f"{m['loss_tokens']} loss tokens"
    )
    if "loss" in m:
        text += (
            f", loss {m['loss']:.4g}, grad norm {m['grad_norm']:.4g}, "
            f"engine/trainer logprob gap {m['logprob_mismatch_max']:.2e}, weights v{m['version']}"
        )
    return text


def format_summary(summary: dict[str, Any]) -> str:
    lines = [f"gyre-ray train: {len(summary['steps'])} step(s) done"]
    lines += [f"  step {i}: {format_step(m)}" for i, m in enumerate(summary["steps"])]
    run_dir = summary["run_dir"]
    lines.append(f"  run folder: {run_dir} (records/, metrics.jsonl, summary.json, workspaces/)")
    lines.append(f"  checkpoint: {summary['checkpoint']} (HF folder + optimizer state)")
    return "\n".join(lines)
