"""The training job: `gyre-ray train --config jobs/configs/toy.yaml [overrides]`.

The driver is thin: config -> `Runtime.start` (cells, store, proxy, the `scheduler` actor) ->
`scheduler.run(steps)` -> stream progress and per-step metrics -> save. The scheduler actor
(`gyre_ray.runtime.scheduler`) runs the whole run: it launches every step's executions while the
staleness bound allows, moves cells between rollout and training by the configured policy (the same
objects the simulator drives), trains each batch's micro-batches as its groups end and publishes
each update to every cell. Everything lands in a run folder: config, call records, metrics,
summary, trace.jsonl, costs.json, workspaces, checkpoints/ (`gyre_ray.checkpoint`; `--resume RUN_DIR`
continues from the newest, `gyre_ray.resume`), eval.jsonl (`run.eval_every`, `gyre_ray.evaluation`)
and report/. On a persistent Ray cluster (RAY_ADDRESS) the run's actors outlive a driver that dies and
`--attach RUN_DIR` takes the run over (`gyre_ray.live_run`).
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from pathlib import Path
from typing import Any

from gyre_ray.agents.harnesses import check_harness_here
from gyre_ray.checkpoint import latest as latest_checkpoint
from gyre_ray.checkpoint import latest_good, load_state, require_good, trainer_dir
from gyre_ray.config import GyreConfig, load_config
from gyre_ray.evaluation import check_tasks_per_step, format_eval, read_eval, reward_text
from gyre_ray.observability.metrics import trend_window
from gyre_ray.resume import EARLIER_SUMMARY, merge_segments, prepare_resume, segment_offset, set_summary_aside
from gyre_ray.resume_checks import check_checkpoint_model, check_resume_settings, keep_config
from gyre_ray.run_folder import replace_text
from gyre_ray.runtime.report import recovery_lines


def register(subparsers: argparse._SubParsersAction) -> None:
    parser = subparsers.add_parser(
        "train", help="run the RL training job (local Ray, or the cluster under ray job submit)"
    )
    parser.add_argument("--config", default=None, help="YAML config (default: built-in defaults)")
    parser.add_argument(
        "--resume",
        default=None,
        metavar="RUN_DIR",
        help="continue this run folder from its newest good checkpoint, with its config (overrides apply, "
        "e.g. run.steps=8 to go on to step 8; model.path/preset/dtype, agents.task_set, "
        "run.tasks_per_step, run.eval_task_set and run.eval_holdout cannot change: docs/checkpoints.md)",
    )
    parser.add_argument(
        "--attach",
        default=None,
        metavar="RUN_DIR",
        help="take over the run alive in this folder on the Ray cluster (RAY_ADDRESS) after its driver "
        "died: stream its remaining steps and finish it (docs/faults.md)",
    )
    parser.add_argument("overrides", nargs="*", help="dotted overrides, e.g. trainer.lr=1e-5 run.steps=2")
    parser.set_defaults(handler=_train_command)


def _train_command(args: argparse.Namespace) -> int:
    from gyre_ray.checkpoint import CheckpointError
    from gyre_ray.config import ConfigError

    if args.attach is not None:
        if args.resume is not None or args.config is not None or args.overrides:
            raise ConfigError("--attach takes the live run as it is: no --resume, --config or overrides")
        summary = train(resume_config(args.attach), attach=args.attach)
    elif args.resume is None:
        summary = train(load_config(args.config, args.overrides))
    elif args.config is not None:
        raise ConfigError("--resume takes the run folder's own config.json; give overrides, not --config")
    else:
        try:
            summary = train(resume_config(args.resume, args.overrides), resume=args.resume)
        except CheckpointError as exc:
            raise ConfigError(f"cannot resume: {exc}") from None
    print(format_summary(summary))
    failure = nothing_scored(summary["steps"])
    if failure:
        print(f"gyre-ray train: {failure}", file=sys.stderr)
        return 1
    return 0


def resume_config(run_dir: str | Path, overrides: list[str] | None = None) -> GyreConfig:
    """The config a run folder was started with (its config.json), with `overrides` applied."""
    from gyre_ray.config import ConfigError

    path = Path(run_dir) / "config.json"
    if not path.is_file():
        raise ConfigError(f"{run_dir} is not a run folder (no config.json)")
    return load_config(path, overrides)


def runs_root(run_dir: str, cwd: Path | None = None) -> Path:
    """Where run folders go: `run.run_dir` made absolute. A relative one inside the temporary working
    directory `ray job submit` unpacks (and deletes after the job) goes under ~/gyre-ray instead."""
    path = Path(run_dir).expanduser()
    if path.is_absolute():
        return path
    cwd = cwd or Path.cwd()
    if "runtime_resources" in cwd.parts:  # /tmp/ray/session_*/runtime_resources/working_dir_files/...
        stable = Path.home() / "gyre-ray" / path
        print(
            f"gyre-ray: run.run_dir={run_dir!r} is relative to a job working directory that Ray deletes; "
            f"using {stable} (set an absolute run.run_dir to choose)",
            flush=True,
        )
        return stable
    return (cwd / path).resolve()


def creatable_runs_root(cfg: GyreConfig) -> Path:
    """`runs_root`, made now (before any slow work): ConfigError naming `run.run_dir` when it cannot be
    (a file on the way, no permission), instead of a traceback after the warm-up."""
    from gyre_ray.config import ConfigError

    root = runs_root(cfg.run.run_dir)
    try:
        root.mkdir(parents=True, exist_ok=True)
    except OSError as exc:
        raise ConfigError(f"run.run_dir={cfg.run.run_dir!r}: cannot make {root}: {exc.strerror}") from None
    return root


def new_run_dir(cfg: GyreConfig) -> Path:
    stamp = time.strftime("%Y%m%d-%H%M%S")
    run_dir = runs_root(cfg.run.run_dir) / f"{cfg.run.name}-{stamp}-{os.getpid()}"
    run_dir.mkdir(parents=True, exist_ok=False)
    (run_dir / "config.json").write_text(cfg.model_dump_json(indent=2))
    return run_dir


def close_run_folder(cfg: GyreConfig, run_dir: Path) -> None:
    """With `agents.workspace_root` the executions work on their nodes' own disk and never need the run
    folder, which on a cluster is a volume their nodes mount: close it (0700) to the sandbox uids
    there (config.json, metrics, checkpoints). Without it, each execution's start opens only the path
    to its workspace (`sandbox.protect_job_folders`)."""
    if cfg.agents.workspace_root is not None and cfg.agents.isolation != "none":
        os.chmod(run_dir, 0o700)


def train(
    cfg: GyreConfig,
    *,
    resume: str | Path | None = None,
    attach: str | Path | None = None,
    engine_factory: Any = None,
    execute: Any = None,
) -> dict[str, Any]:
    """Run `cfg.run.steps` RL steps end to end and return the run summary (also saved as summary.json).

    Thin: config -> runtime -> `scheduler.run(steps)` -> stream progress and per-step metrics -> save.
    `resume`: a run folder to continue from its newest checkpoint (`gyre_ray.resume`), up to
    `cfg.run.steps`. If the core cell dies, the run restarts from its newest checkpoint by itself
    (`gyre_ray.core_restart`, at most `run.max_core_restarts` times). `engine_factory` / `execute`
    (an execution runner with `run_planned_execution`'s signature) are for tests and benchmarks.
    `attach`: the folder of a run alive on the cluster (its config.json as `cfg`): finish it
    (`gyre_ray.live_run`).
    """
    from gyre_ray import live_run
    from gyre_ray.warmup.sft import prepare_policy

    live, restarts = None, []
    progress = {"restored": resume is None}  # a resume changes the folder's config only once restored
    checkpoint = None
    resumed = Path(resume).resolve() if resume is not None else None
    if resumed is not None:  # what a resume may not change, and its checkpoint, before the warm-up
        check_resume_settings(cfg, resume)
        live_run.refuse_running_driver(resumed)
        live_run.refuse_if_alive(cfg, resumed)
        checkpoint = require_good(resumed, warn=_say)  # a damaged newest one is skipped
    if attach is not None:  # config.json holds the prepared policy already
        run_dir = Path(attach).resolve()
        live = live_run.attach(cfg, run_dir)
        start, restarts = live.start, live.restarts
    else:
        check_model_path(cfg)  # a missing or torn model folder fails here, not in every cell
        # an impossible split or step, or a harness not installed here, fails before the warm-up
        check_tasks_per_step(cfg)
        check_harness_here(cfg.agents)
        if resumed is None:  # a resumed run's config holds its prepared policy (its checkpoint, the weights)
            cfg = prepare_policy(cfg, creatable_runs_root(cfg))  # the warm-up (a no-op when off), cached
    if resumed is not None:
        run_dir = resumed
        check_checkpoint_model(cfg, checkpoint)
        start = _resume_folder(cfg, run_dir, checkpoint)
    elif attach is None:
        run_dir, start = new_run_dir(cfg), None
    close_run_folder(cfg, run_dir)
    live_run.mark_driver(run_dir)  # `gyre-ray runs`: running (removed below, left by a killed driver)
    try:
        summary = _run_segments(cfg, run_dir, start, restarts, (engine_factory, execute), live, progress)
    except BaseException as exc:
        if not progress["restored"]:  # the folder is as it was: its plain `--resume` still applies
            print(
                f"gyre-ray: the resume failed before its checkpoint was restored; {run_dir}/config.json "
                "is unchanged (a plain `--resume` starts from the same checkpoint)",
                file=sys.stderr,
                flush=True,
            )
            raise
        note_failure(run_dir, exc)
        raise
    finally:
        live_run.clear_driver(run_dir)
    failure = nothing_scored(summary["steps"])
    if failure:  # every step ran, but no execution was scored: nothing was learned
        note_failure(run_dir, RuntimeError(failure), quiet=True)
    else:
        (run_dir / FAILED_FILE).unlink(missing_ok=True)  # a resumed run that ends well is no failed run
    return summary


NOTHING_SCORED = "no execution was scored"


def nothing_scored(steps: list[dict[str, Any]]) -> str | None:
    """Why a run whose steps all ran learned nothing (no execution scored in any step), or None."""
    if not steps or scored_rewards(steps):
        return None
    reasons: dict[str, int] = {}
    for m in steps:
        for why, n in (m.get("drop_reasons") or {}).items():
            reasons[why] = reasons.get(why, 0) + int(n)
    said = ", ".join(f"{n} {why}" for why, n in sorted(reasons.items(), key=lambda kv: -kv[1])[:3])
    return (
        f"{NOTHING_SCORED} in any of the {len(steps)} step(s) ({said or 'every one dropped'}), so "
        "nothing was learned: check the harness (agents.*); each execution's log is under the run "
        "folder's workspaces/"
    )


FAILED_FILE = "failed.json"


def _say(line: str) -> None:
    print(line, flush=True)


def check_model_path(cfg: GyreConfig) -> None:
    """A ConfigError before any Ray actor starts when `model.path` is not a loadable HF folder here
    (on a cluster that outlives the driver, a path only the workers see is left to them)."""
    from gyre_ray.config import ConfigError
    from gyre_ray.live_run import persistent_cluster
    from gyre_ray.model.checkpoint import check_hf_folder

    path = cfg.model.path
    if not path or (not Path(path).exists() and persistent_cluster()):
        return
    try:
        check_hf_folder(path)
    except (OSError, ValueError) as exc:
        raise ConfigError(f"model.path: {exc}") from None


def error_text(exc: BaseException) -> str:
    """`Type: message` of what went wrong, one paragraph: a Ray task error is unwrapped to its cause
    (its text holds the remote traceback) and terminal colour codes are dropped."""
    import re

    from gyre_ray.proxy.errors import root_cause

    exc = root_cause(exc)
    text = re.sub(r"\x1b\[[0-9;]*m", "", f"{type(exc).__name__}: {exc}")
    return text if len(text) <= 2000 else text[:2000] + " ..."


def note_failure(run_dir: Path, exc: BaseException, quiet: bool = False) -> None:
    """Say in the run folder why the run stopped (`failed.json`: the error, when, the steps logged);
    the folder keeps what was saved before (metrics, records, checkpoints: `--resume` continues).
    `quiet`: the caller says why itself (nothing on stderr here)."""
    from gyre_ray.config import ConfigError
    from gyre_ray.proxy.store_files import json_lines

    why = "interrupted" if isinstance(exc, KeyboardInterrupt) else error_text(exc)
    note = {
        "error": why,
        "failed_at": time.strftime("%Y-%m-%dT%H:%M:%S%z"),
        "steps_logged": sum(1 for _ in json_lines(run_dir / "metrics.jsonl")),
    }
    try:
        (run_dir / FAILED_FILE).write_text(json.dumps(note, indent=2))
    except OSError:  # the folder itself is what failed (a full or read-only disk): the error says so
        return
    if quiet:
        return
    if isinstance(exc, ConfigError) and not note["steps_logged"]:  # the next line says what to change
        print(
            f"gyre-ray: the run did not start; {run_dir / FAILED_FILE} says why", file=sys.stderr, flush=True
        )
        return
    saved = latest_good(run_dir)
    then = (
        f"`gyre-ray train --resume {run_dir}` continues from step {int(load_state(saved)['step'])}"
        if saved is not None
        else "no checkpoint to resume from yet (run.checkpoint_every=N saves one every N steps)"
    )
    print(f"gyre-ray: the run stopped; {run_dir / FAILED_FILE} says why; {then}", file=sys.stderr, flush=True)


def _run_segments(
    cfg: GyreConfig,
    run_dir: Path,
    start: tuple[Path | None, int, float] | None,
    restarts: list[dict[str, Any]],
    factories: tuple[Any, Any],
    live: Any,
    progress: dict[str, bool] | None = None,
) -> dict[str, Any]:
    """`_run_segment` until one ends the run, restarting from the newest checkpoint when the core dies."""
    from gyre_ray.core_restart import CoreLost, describe, plan_restart

    while True:
        try:
            return _run_segment(cfg, run_dir, start, restarts, factories, live, progress)
        except CoreLost as lost:
            live = None
            limit = cfg.run.max_core_restarts
            if len(restarts) >= limit:
                raise RuntimeError(
                    f"{lost.why}; run.max_core_restarts={limit} restart(s) already used: stopping "
                    f"(`gyre-ray train --resume {run_dir}` continues from the newest checkpoint)"
                ) from lost
            row, checkpoint = plan_restart(run_dir, lost, len(restarts) + 1, warn=_say)
            restarts.append(row)
            print(describe(row, limit), flush=True)
            start = _resume_folder(cfg, run_dir, checkpoint)


def _run_segment(
    cfg: GyreConfig,
    run_dir: Path,
    start: tuple[Path | None, int, float] | None,
    restarts: list[dict[str, Any]],
    factories: tuple[Any, Any],
    live: Any = None,
    progress: dict[str, bool] | None = None,
) -> dict[str, Any]:
    """One runtime's part of the run: from `start` ((checkpoint or None, first step, time offset);
    None = a new run) to the end; raises `CoreLost` when the core cell dies on the way. `live`: the
    `LiveRun` attached to (its runtime runs already); `factories`: (engine_factory, execute).
    A resumed segment writes its config into config.json once the checkpoint is restored (and sets
    `progress["restored"]`); the earlier segment's goes to config.segment-<k>.json if it differs."""
    import ray

    from gyre_ray import live_run
    from gyre_ray.core_restart import CoreLost, core_loss, keep_trace, updates_done
    from gyre_ray.drive import drive
    from gyre_ray.observability.metrics import MetricsLogger
    from gyre_ray.runtime.cluster import Runtime
    from gyre_ray.runtime.report import write_costs, write_trace

    engine_factory, execute = factories
    checkpoint_in, first_step, offset = start or (None, 0, 0.0)
    config_text = cfg.model_dump_json(indent=2)
    cfg = cfg.model_copy(
        update={"proxy": cfg.proxy.model_copy(update={"records_dir": str(run_dir / "records")})}
    )
    print(f"gyre-ray: run folder {run_dir}", flush=True)
    logger = MetricsLogger(
        run_dir, run_dir.name, json.loads(cfg.model_dump_json()), cfg.run.wandb_mode,
        resume=start is not None or live is not None,
    )  # fmt: skip
    try:
        if live is None:
            options = {"run_dir": str(run_dir), "execute": execute}
            detached = live_run.persistent_cluster()
            runtime = Runtime.start(cfg, engine_factory, scheduler_options=options, detached=detached)
        else:
            runtime = live.runtime
        try:
            print(
                f"gyre-ray: proxy at {runtime.proxy.base_url}; {_plural(len(runtime.cells), 'dual-role cell')} "
                f"({runtime.core_id} is the core) in Ray namespace {runtime.namespace}; scheduler policy "
                f"{cfg.scheduler.policy}, staleness bound {cfg.scheduler.staleness}",
                flush=True,
            )
            if checkpoint_in is not None and live is None:
                version = runtime.restore(checkpoint_in)
                print(f"gyre-ray: resumed from {checkpoint_in} (step {first_step}, weights v{version})")
            if start is not None and live is None:
                keep_config(run_dir, config_text)
                set_summary_aside(run_dir)  # no proof the run ended until this segment writes one
            if progress is not None:
                progress["restored"] = True
            if live is not None:
                print(
                    f"gyre-ray: attached to the live run; {live.logged} of its step(s) logged before",
                    flush=True,
                )
            elif runtime.detached:
                live_run.record(run_dir, runtime, start, restarts)
            try:
                logged = live.logged if live is not None else None
                result = drive(runtime, cfg, logger, run_dir, (first_step, offset), execute, logged)
            except Exception as exc:
                why = core_loss(runtime, exc)
                if why is None:
                    raise
                keep_trace(runtime, run_dir, first_step, offset)
                raise CoreLost(why, updates_done(runtime, first_step)) from exc
            if start is not None:
                result = merge_segments(run_dir, first_step, offset, result)
            write_trace(run_dir, result["trace"])
            write_costs(run_dir, result["costs"])
            saved = latest_checkpoint(run_dir) if cfg.run.checkpoint_every else None
            if saved is not None and load_state(saved)["step"] == cfg.run.steps:
                checkpoint = trainer_dir(saved)
            else:
                checkpoint = ray.get(runtime.core.save.remote(str(run_dir / "checkpoint")), timeout=600)
        finally:
            runtime.stop_actors()
            live_run.forget(run_dir)  # before the slow rest: `ray job stop` SIGKILLs 3 s after its SIGTERM
            runtime.shutdown()
        summary = {
            "run_dir": str(run_dir),
            "checkpoint": str(checkpoint),
            "steps": result["steps"],
            "costs": result["costs"],
            "utilisation": result["utilisation"],
            "spans": result["spans"],  # each cell's work: (cell, rollout|training|switching, from_s, to_s)
            "switches": result["switches"],
            "eval": read_eval(run_dir),
            "core_restarts": restarts,
            "scheduler_restarts": result.get("scheduler_restarts", []),
            "faults": result.get("faults", []),  # cells lost, groups processed again (docs/faults.md)
            "runner_losses": result.get("runner_losses", []),  # executions started again
        }
        replace_text(run_dir / "summary.json", json.dumps(summary, indent=2))
        (run_dir / EARLIER_SUMMARY).unlink(missing_ok=True)
        report = _write_report(run_dir)
        logger.finish_run(summary, report)
    finally:
        logger.close()
    return summary


def _resume_folder(cfg: GyreConfig, run_dir: Path, checkpoint: Path | None) -> tuple[Path | None, int, float]:
    """(the checkpoint it resumes from, the step it resumes at, the new segment's time offset); what
    the folder holds of later steps is set aside. No checkpoint (a core lost before the first one):
    the run starts again at step 0."""
    from gyre_ray.config import ConfigError

    state = load_state(checkpoint) if checkpoint is not None else {}
    first_step = int(state.get("step", 0))
    saved_seed = state.get("seed")
    if saved_seed is not None and int(saved_seed) != cfg.run.seed:
        print(
            f"gyre-ray: warning: {run_dir} ran with run.seed={saved_seed}, resumed with run.seed={cfg.run.seed}: "
            "steps from here draw other task samples and harness seeds than the first run would have"
        )
    cursor = state.get("task_cursor")
    if cursor is not None and int(cursor) != first_step * cfg.run.tasks_per_step:
        raise ConfigError(
            f"run.tasks_per_step cannot change on resume: {checkpoint} saved task cursor {cursor} at step "
            f"{first_step} (run.tasks_per_step={int(cursor) // max(first_step, 1)}), given "
            f"run.tasks_per_step={cfg.run.tasks_per_step}"
        )
    if first_step >= cfg.run.steps:
        raise ConfigError(
            f"{run_dir} has done {first_step} step(s), run.steps={cfg.run.steps}: nothing to resume "
            f"(give run.steps={first_step + 1} or more to go on)"
        )
    aside = prepare_resume(run_dir, first_step)
    offset = segment_offset(run_dir, first_step)  # after the rows the resume put back
    if aside["moved"] or aside["rows_set_aside"]:
        print(
            f"gyre-ray: {aside['moved']} record/workspace entries and {aside['rows_set_aside']} metrics/trace/"
            f"eval rows of steps >= {first_step} set aside in {aside['to']}"
        )
    if aside.get("recovered"):
        print(
            f"gyre-ray: metrics of step(s) {', '.join(map(str, aside['recovered']))} (published, never "
            "logged: the driver stopped first) put back into metrics.jsonl"
        )
    if aside.get("recovered_trace"):
        print(
            f"gyre-ray: {aside['recovered_trace']} trace row(s) of steps the killed segment published put back into trace.jsonl (from its journal)"
        )
    return checkpoint, first_step, offset


def _write_report(run_dir: Path) -> Path | None:
    """The run's pictures (`gyre-ray report`); a failure to draw never fails the run."""
    from gyre_ray.observability.report import write_report

    try:
        index = write_report(run_dir)
    except Exception as exc:
        print(f"gyre-ray: no report ({type(exc).__name__}: {exc})", flush=True)
        return None
    print(f"gyre-ray: report {index}", flush=True)
    return index


def _logprob_gap(m: dict[str, Any]) -> str:
    """The largest |behaviour - trainer| log-prob of a loss token. On-policy it checks that engine and
    trainer agree (numerics only); with stale tokens it also holds the policy's change since they were
    generated, so the line says so rather than call it an engine/trainer mismatch."""
    oldest = (m.get("staleness") or {}).get("max", 0)
    if not oldest:
        return f", engine/trainer logprob gap {m['logprob_gap_max']:.2e}"
    return (
        f", behaviour/trainer logprob gap {m['logprob_gap_max']:.2e} "
        f"(tokens up to {oldest} version{'s' if oldest > 1 else ''} old: the policy moved since)"
    )


def format_step(m: dict[str, Any]) -> str:
    if m.get("recovered_after_scheduler_restart"):  # the scheduler died between the update and its row
        return (
            "update applied; its metrics were lost with the scheduler actor that died before publishing them"
        )
    text = (
        f"{m['valid']}/{m['executions']} executions scored (timeouts {m['timed_out']}), "
        f"reward {reward_text(m['reward_mean'])}{_task_rewards(m)}{_dropped(m)}, {m['calls']} model calls, paths {m['paths_selected']}/{m['paths_total']} kept, "
        f"tokens {m['tokens_expanded_all']} expanded -> {m['tokens_packed_selected']} packed, "
        f"{m['loss_tokens']} loss tokens"
    )
    if m.get("executions_untrained"):
        n = m["executions_untrained"]
        text += f" ({_plural(n, 'execution')} of advantage 0 not trained: zero gradient)"
    if "loss" in m:
        text += f", loss {m['loss']:.4g}, grad norm {m['grad_norm']:.4g}"
        if "logprob_gap_max" in m:
            text += _logprob_gap(m)
        if "nll_mean" in m:
            text += (
                f", sampled-token NLL {m['nll_mean']:.3f} nats, KL(behaviour||policy) {m['kl_behaviour']:.2e}, "
                f"clip fraction {m['clip_fraction']:.2f}"
            )
        trained = ", ".join(f"{cell} {n}" for cell, n in sorted(m.get("trained_by_cell", {}).items()))
        text += f", micro-batches trained by cell: {trained}, weights v{m['version']}"
    switches = m.get("switches", [])
    if switches:
        text += f"; {_plural(len(switches), 'role switch', 'role switches')}"
    stale = m.get("staleness")
    if stale:
        text += (
            f"; trained-token staleness max {stale['max']} mean {stale['mean']:.2f}; overlap {m['overlap_s']:.1f} s "
            f"(rollout of later steps ran while this step trained; {m['later_executions_started']} of their "
            "executions had started)"
        )
    model = m.get("duration_model")
    if model:
        text += (
            f"; sibling order not yet on a fitted duration model ({model['error']})"
            if "error" in model
            else f"; sibling order's duration model refitted to {model['executions']} ended executions "
            f"(mu {model['mu_log_hours']:.3f} log h, sigma {model['sigma_log_hours']:.3f}, rho {model['rho']:.2f})"
        )
    return text


def _plural(n: int, one: str, many: str | None = None) -> str:
    return f"{n} {one if n == 1 else many or one + 's'}"


def scored_rewards(steps: list[dict[str, Any]]) -> list[float]:
    """The mean rewards of the steps that scored at least one execution (a step whose every execution
    was dropped, e.g. a harness that could not start, has no reward: it is not a reward of 0)."""
    return [float(m["reward_mean"]) for m in steps if m.get("reward_mean") is not None]


def _dropped(m: dict[str, Any]) -> str:
    reasons = m.get("drop_reasons") or {}
    return f" [dropped: {', '.join(f'{n} {why}' for why, n in reasons.items())}]" if reasons else ""


def _task_rewards(m: dict[str, Any]) -> str:
    by_task = m.get("reward_by_task") or {}
    return f" ({', '.join(f'{t} {r:.3f}' for t, r in by_task.items())})" if by_task else ""


def reward_trend(steps: list[dict[str, Any]], window: int = 3) -> str:
    """Mean reward of the first `window` scored steps vs the last `window`, and every step's mean reward
    (`n/a`: a step that scored no execution, left out of the trend)."""
    rewards = scored_rewards(steps)
    if not rewards:
        return "reward trend: no scored steps"
    k = trend_window(len(rewards), window)
    first, last = sum(rewards[:k]) / k, sum(rewards[-k:]) / k
    return (
        f"reward trend: first {k} step(s) {first:.3f} -> last {k} step(s) {last:.3f} ({last - first:+.3f}); "
        f"per step {' '.join(reward_text(m.get('reward_mean'), 2) for m in steps)}"
    )


def format_summary(summary: dict[str, Any]) -> str:
    lines = [f"gyre-ray train: {len(summary['steps'])} step(s) done"]
    lines += [f"  step {m['step']}: {format_step(m)}" for m in summary["steps"]]
    lines.append(f"  {reward_trend(summary['steps'])}")
    run_dir = summary["run_dir"]
    lines.append(
        f"  run folder: {run_dir} (records/, metrics.jsonl, summary.json, trace.jsonl, costs.json, workspaces/)"
    )
    lines.append(f"  checkpoint: {summary['checkpoint']} (HF folder + optimizer state)")
    lines += [f"  {format_eval(row)}" for row in summary.get("eval", [])]
    for row in summary.get("core_restarts", []):
        lines.append(
            f"  core restart {row['restart']}: {row['why']}; resumed from step {row['resumed_from_step']} "
            f"({row['steps_lost']} finished step(s) lost)"
        )
    lines += [f"  {line}" for line in recovery_lines(summary)]
    costs = summary.get("costs")
    if costs:
        lines.append(
            f"  makespan {costs['makespan_s']:.1f} s; trace.jsonl and costs.json in the run folder "
            f"(`gyre-ray simulate --trace {run_dir}` replays them)"
        )
    return "\n".join(lines)
