"""The driver's part of a run segment: start (or join) the scheduler's run, stream its steps, return its result.

`drive` is what `gyre_ray.train` does between starting the runtime and saving the run: it calls
`scheduler.run`, or `scheduler.join` when it attaches to a run whose driver died
(`gyre_ray.live_run`), and until the run ends logs each new step's metrics (metrics.jsonl, wandb, a
progress line), starts the evaluation rounds that are due and shows the scheduler's progress.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from gyre_ray.config import GyreConfig
from gyre_ray.evaluation import EvalRunner, eval_due, format_eval
from gyre_ray.resume import shift_step


def drive(
    runtime: Any,
    cfg: GyreConfig,
    logger: Any,
    run_dir: Path,
    start: tuple[int, float],
    execute: Any,
    logged: int | None = None,
) -> dict[str, Any]:
    """`scheduler.run` to the end, streaming each step's metrics (and evaluation rounds) as they come.

    `start`: (the step the run starts at, the seconds to add to its times: both 0 unless resumed).
    `logged`: attach to the run the scheduler holds (`scheduler.join`) instead of starting one; that
    many of its steps are logged already. The evaluation round due at the start is the first driver's."""
    import ray

    from gyre_ray.observability.progress import Progress
    from gyre_ray.train import format_step

    scheduler, every = runtime.scheduler, cfg.run.eval_every
    first_step, offset = start
    evaluator = None
    version = int(ray.get(runtime.core.trainer_version.remote(), timeout=60))
    if every:
        executors, base_url = runtime.agent_executors()  # the runners, if any, as for training
        evaluator = EvalRunner(
            cfg, runtime.store, executors, base_url, run_dir, execute, proxy=runtime.proxy_admin()
        )
        if logged is None and eval_due(first_step, every, cfg.run.steps):
            evaluator.start(first_step, version)
    call = scheduler.run if logged is None else scheduler.join
    done = call.remote(cfg.run.steps, first_step=first_step, checkpoint_every=cfg.run.checkpoint_every)
    seen = logged or 0
    with Progress("run", total=cfg.run.steps - first_step) as progress:
        while True:
            finished, _ = ray.wait([done], timeout=1.0)
            for metrics in patient_get(scheduler.metrics_since.remote(seen)):
                seen += 1
                metrics = shift_step(metrics, offset)
                logger.log(metrics["step"], metrics)
                print(f"gyre-ray: step {metrics['step']}: {format_step(metrics)}", flush=True)
                # (a row a restarted scheduler wrote before rows carried it may lack it)
                version = int(metrics.get("version", version))
                if evaluator is not None and eval_due(metrics["step"] + 1, every, cfg.run.steps):
                    evaluator.start(metrics["step"] + 1, version)
            if evaluator is not None:
                _log_eval(logger, evaluator.poll(version))
            snapshot = patient_get(scheduler.progress.remote())
            progress.update(seen, note=_progress_note(snapshot))
            if finished:
                break
        result = ray.get(done)  # inside: a run that raised ends its progress line "stopped on an error"
    if evaluator is not None:
        _log_eval(logger, evaluator.finish(version))
    return result


def patient_get(ref: Any, timeout_s: float = 60.0) -> Any:
    """`ray.get(ref)`, waiting on past each `timeout_s` with a note: on a busy machine the scheduler
    actor can take minutes to answer a poll, which is no reason to end the run. A dead actor still
    raises at once (ActorDiedError)."""
    import ray

    waited = 0.0
    while True:
        try:
            return ray.get(ref, timeout=timeout_s)
        except ray.exceptions.GetTimeoutError:
            waited += timeout_s
            print(
                f"gyre-ray: the scheduler has not answered for {waited:.0f} s (busy machine?); waiting",
                flush=True,
            )


def _log_eval(logger: Any, rows: list[dict[str, Any]]) -> None:
    for row in rows:
        logger.log_eval(row)
        print(f"gyre-ray: {format_eval(row)}", flush=True)


def _progress_note(snapshot: dict[str, Any]) -> str:
    if not snapshot.get("started"):
        return "starting"
    training = sum(p != "rollout" for p in snapshot["phases"].values())
    return (
        f"{snapshot['running']} executions running, {snapshot['ended']}/{snapshot['executions']} ended, "
        f"{training}/{len(snapshot['phases'])} cells training or switching"
    )
