"""Evaluation: the current policy on held-out tasks, never trained on, scored per task per step.

    train_tasks, held_out = split_tasks(cfg)          # what the scheduler trains on / what is evaluated
    runner = EvalRunner(cfg, store, executors, base_url, run_dir)  # executors: Runtime.agent_executors
    runner.start(step, version)                       # launch one round (eval_samples per held-out task)
    rows = runner.poll(version)                       # rounds that ended (also appended to eval.jsonl)

The held-out split is `run.eval_task_set` when set (training keeps all of `agents.task_set`), else the
last `run.eval_holdout` tasks of `agents.task_set`, which training then skips. A round's executions
run through the proxy and the rollout cells like any other, but no group is formed and nothing is
trained on them. Sampling uses fixed seeds: the toy harness seeds its calls from the workspace's name,
and a round's workspaces are named `eval-<task>-<i>` in every round (`workspaces/eval-<step>/...`),
so rounds differ by the policy, not by the draw. `step` is the number of updates the evaluated policy
has had; a round starts right after that version is published while training goes on, so its later
calls may meet the next version when a round outlasts a step: each row says which versions were
published while it ran (`version`, `version_at_end`).
"""

from __future__ import annotations

import json
import statistics
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from gyre_ray.agents.outcomes import outcome_metrics
from gyre_ray.agents.relaunch import relaunch_id
from gyre_ray.config import ConfigError, GyreConfig
from gyre_ray.envs.base import Task, get_task_set
from gyre_ray.proxy.store_files import json_lines
from gyre_ray.runtime.runners import (
    EXECUTOR_BACK_WITHIN_S,
    RUNNER_PROBE_EVERY_S,
    ExecutorLostError,
    register_again,
)

EVAL_FILE = "eval.jsonl"


def split_tasks(cfg: GyreConfig) -> tuple[list[Task], list[Task]]:
    """(training tasks, held-out tasks) of the run; the held-out list is empty when eval is off."""
    tasks = get_task_set(cfg.agents.task_set)
    run = cfg.run
    if not run.eval_every:
        return tasks, []
    if run.eval_task_set:
        return tasks, get_task_set(run.eval_task_set)
    if len(tasks) <= run.eval_holdout:
        raise ConfigError(
            f"agents.task_set {cfg.agents.task_set!r} has {len(tasks)} task(s): holding out "
            f"run.eval_holdout={run.eval_holdout} would leave none to train on; set run.eval_task_set"
        )
    return tasks[: -run.eval_holdout], tasks[-run.eval_holdout :]


def check_tasks_per_step(cfg: GyreConfig) -> list[Task]:
    """The run's training tasks (`split_tasks`), or a ConfigError when a step would need more distinct
    tasks than they are (a task twice in one step would give two executions the same id)."""
    tasks = split_tasks(cfg)[0]
    if cfg.run.tasks_per_step > len(tasks):
        held = (
            f" after run.eval_holdout={cfg.run.eval_holdout} held out"
            if cfg.run.eval_every and not cfg.run.eval_task_set
            else ""
        )
        raise ConfigError(
            f"run.tasks_per_step={cfg.run.tasks_per_step} but agents.task_set {cfg.agents.task_set!r} has "
            f"{len(tasks)} training task(s){held}: a step runs distinct tasks, so give run.tasks_per_step <= {len(tasks)}"
        )
    return tasks


def eval_task_set_name(cfg: GyreConfig) -> str:
    """The task set the held-out tasks are looked up in (by id) when an execution runs."""
    return cfg.run.eval_task_set or cfg.agents.task_set


def eval_due(step: int, every: int, last: int) -> bool:
    """Whether the policy after `step` updates is evaluated: step 0, every `every`-th, and the last."""
    return every > 0 and (step % every == 0 or step == last)


@dataclass(frozen=True)
class EvalItem:
    """One evaluated execution: its store id, its task and its workspace."""

    execution_id: str
    task_id: str
    workspace: Path


def plan_round(tasks: list[Task], samples: int, step: int, workspaces: Path, tag: str = "") -> list[EvalItem]:
    """`samples` executions of every held-out task; workspace names repeat across rounds (fixed seeds)."""
    return [
        EvalItem(
            f"{tag}eval{step}-{t.task_id}-{i}",
            t.task_id,
            workspaces / f"eval-{step}" / f"eval-{t.task_id}-{i}",
        )
        for t in tasks
        for i in range(samples)
    ]


def summarize(
    step: int, outcomes: list[Any], threshold: float, version: int, version_at_end: int
) -> dict[str, Any]:
    """One round's row: reward and pass rate per task and overall (over executions that got a score)."""
    by_task: dict[str, list[float]] = {}
    for o in outcomes:
        by_task.setdefault(o.task_id, [])
        if o.valid:
            by_task[o.task_id].append(float(o.reward))
    scored = [r for rs in by_task.values() for r in rs]
    dropped = outcome_metrics(outcomes)
    return {
        "step": step,
        "version": version,
        "version_at_end": version_at_end,
        "executions": len(outcomes),
        "valid": len(scored),
        "reward_mean": statistics.fmean(scored) if scored else None,  # None: no execution scored
        "pass_rate": sum(r >= threshold for r in scored) / len(scored) if scored else 0.0,
        "tasks": {
            task: {
                "reward": statistics.fmean(rs) if rs else None,  # None: none of its executions scored
                "pass_rate": sum(r >= threshold for r in rs) / len(rs) if rs else 0.0,
                "valid": len(rs),
            }
            for task, rs in sorted(by_task.items())
        },
        "dropped": dropped["dropped"],
        "drop_reasons": dropped["drop_reasons"],  # kind of reason -> executions, as a step's metrics count
    }


def read_eval(run_dir: str | Path) -> list[dict[str, Any]]:
    """The run's evaluation rows (`eval.jsonl`), in the order they ended; [] when there are none."""
    return list(json_lines(Path(run_dir) / EVAL_FILE))  # up to a line torn by a killed job


def flat_metrics(row: dict[str, Any]) -> dict[str, float]:
    """A round as flat `eval/...` scalars (wandb, the progress line)."""
    flat = {
        "eval/step": float(row["step"]),
        "eval/reward_mean": row["reward_mean"],
        "eval/pass_rate": row["pass_rate"],
    }
    for task, figures in row["tasks"].items():
        flat[f"eval/{task}/reward"] = figures["reward"]
        flat[f"eval/{task}/pass_rate"] = figures["pass_rate"]
    return flat


@dataclass
class _WaitingStart:
    """An execution to start again (`item`, under `key`) once executor `executor` answers: Ray is
    restarting it, and a call sent before the new process is up would fail too."""

    item: EvalItem
    key: str
    executor: int
    since: float  # monotonic: when its executor was found dead
    probe: Any = None  # an outstanding `node_ip` call; None: ask again at `due`
    due: float = 0.0


@dataclass
class _Round:
    step: int
    version: int
    items: list[EvalItem]
    refs: list[Any]
    executor: list[int]  # the index (in `EvalRunner.executors`) each item runs on
    ended: set[Any] = field(default_factory=set)  # refs whose execution came back (not lost)
    waiting: dict[int, _WaitingStart] = field(default_factory=dict)  # item index -> its start again

    def running(self) -> list[Any]:
        """The executions under way (not ended, not waiting to start again)."""
        return [ref for i, ref in enumerate(self.refs) if ref not in self.ended and i not in self.waiting]

    def execution_ids(self) -> list[str]:
        """Every execution id of the round: its items' and those of its starts still waiting."""
        waiting = [start.item.execution_id for start in self.waiting.values()]
        return [item.execution_id for item in self.items] + waiting

    def in_flight(self) -> list[Any]:
        """What may still come back: executions under way and the probes of executors being waited for."""
        return self.running() + [w.probe for w in self.waiting.values() if w.probe is not None]


class EvalRunner:
    """Launches evaluation rounds as executions of the run's `workers` actor, or dealt out over its
    runner actors (`agents.runners`: `Runtime.agent_executors`), and collects their rows.

    An execution whose executor dies under it starts again from the beginning on the next executor
    (a restarted `workers` where there is no other), under a new id (`r1.<id>`) and workspace (the
    same seed), the lost one's key revoked, as soon as that executor answers (`poll` never blocks
    on Ray restarting it); `MAX_STARTS` starts of one execution, or an executor not back within
    `EXECUTOR_BACK_WITHIN_S`, abandon the round (a warning, no row; training goes on).

    A round that ends, or is abandoned, has its executions finished in the store (`_retire`): their
    records go to disk, their keys are revoked, so an abandoned round's harnesses that live on get
    no more model calls.
    """

    def __init__(
        self,
        cfg: GyreConfig,
        store: Any,
        executors: list[Any],
        base_url: str,
        run_dir: str | Path,
        execute: Any = None,
        tag: str = "",
        proxy: dict[str, str] | None = None,
    ) -> None:
        from gyre_ray.agents.launch import run_planned_execution

        self.cfg = cfg
        self.tasks = split_tasks(cfg)[1]
        if not self.tasks:
            raise ValueError("no held-out tasks to evaluate (run.eval_every is 0)")
        self.task_set = eval_task_set_name(cfg)
        self.store, self.base_url = store, base_url
        self.executors = list(executors)
        self.agents = cfg.agents.model_dump()  # what each execution's harness runner is handed
        self.run_dir = Path(run_dir)
        self.execute = execute or run_planned_execution
        self.tag = tag
        self.proxy = proxy  # {"base_url", "admin_token"}: ended rounds are finished through it (`_retire`)
        self.rounds: list[_Round] = []
        self.done_steps = {row["step"] for row in read_eval(self.run_dir)}

    def start(self, step: int, version: int) -> bool:
        """Launch the round of the policy after `step` updates (unless one already ran); True if launched."""
        import ray

        if step in self.done_steps or any(r.step == step for r in self.rounds):
            return False
        workspaces = self.cfg.agents.workspaces_dir(self.run_dir)
        items = plan_round(self.tasks, self.cfg.run.eval_samples, step, workspaces, self.tag)
        keys = ray.get(
            [self.store.register.remote(i.execution_id, {"task_id": i.task_id, "eval": True}) for i in items],
            timeout=60,
        )
        executor = [index % len(self.executors) for index in range(len(items))]
        refs = [self._execute(i, k["api_key"], e) for i, k, e in zip(items, keys, executor, strict=True)]
        self.rounds.append(_Round(step, version, items, refs, executor))
        return True

    def _execute(self, item: EvalItem, api_key: str, executor: int) -> Any:
        from gyre_ray.agents.runner import Endpoint

        return self.executors[executor].execute.remote(
            self.execute, item.execution_id, self.task_set, item.task_id, Endpoint(self.base_url, api_key),
            str(item.workspace), self.agents, run_seed=self.cfg.run.seed,
        )  # fmt: skip

    def _start_lost_again(self, rnd: _Round) -> None:
        """Executions of `rnd` whose executor died under them, started again on the next executor."""
        import ray
        from ray.exceptions import RayActorError

        self._start_waiting(rnd)
        waiting = rnd.running()
        ready = set(ray.wait(waiting, num_returns=len(waiting), timeout=0)[0]) if waiting else set()
        for index, ref in enumerate(rnd.refs):
            if ref not in ready:  # (a start waiting for its executor is not among them)
                continue
            try:
                ray.get(ref, timeout=0)
            except RayActorError:
                self._start_again(rnd, index)
                continue
            except Exception:  # noqa: BLE001 - the execution's own error: raised when the round is read
                pass
            rnd.ended.add(ref)

    def _start_again(self, rnd: _Round, index: int) -> None:
        """Item `index` of `rnd` again, on the next executor, in a fresh workspace with the same seed,
        once that executor answers (`_start_waiting`)."""
        item, executor = rnd.items[index], (rnd.executor[index] + 1) % len(self.executors)
        meta = {"task_id": item.task_id, "eval": True}
        again_id, key = register_again(
            self.store, item.execution_id, meta, f"evaluation executor {rnd.executor[index]}"
        )
        workspace = item.workspace.with_name(relaunch_id(item.workspace.name))  # (the same seed)
        rnd.waiting[index] = _WaitingStart(
            EvalItem(again_id, item.task_id, workspace), key, executor, time.monotonic()
        )
        print(f"gyre-ray: evaluation execution {item.execution_id} lost its executor; it starts again as "
              f"{again_id} once evaluation executor {executor} answers", file=sys.stderr, flush=True)  # fmt: skip
        self._start_waiting(rnd)

    def _start_waiting(self, rnd: _Round) -> None:
        """Send each waiting start of `rnd` whose executor answers; ask the others again every
        `RUNNER_PROBE_EVERY_S`; ExecutorLostError once one has waited `EXECUTOR_BACK_WITHIN_S`."""
        import ray

        for index, start in list(rnd.waiting.items()):
            now = time.monotonic()
            if start.probe is None and start.due <= now:
                start.probe = self.executors[start.executor].node_ip.remote()
            if start.probe is not None and ray.wait([start.probe], timeout=0)[0]:
                try:
                    ray.get(start.probe, timeout=0)
                except Exception:  # noqa: BLE001 - still down or restarting (RayActorError), or its
                    # answer lost: ask again later (EXECUTOR_BACK_WITHIN_S bounds the wait)
                    start.probe, start.due = None, now + RUNNER_PROBE_EVERY_S
                else:
                    del rnd.waiting[index]
                    ref = self._execute(start.item, start.key, start.executor)
                    rnd.items[index], rnd.refs[index], rnd.executor[index] = start.item, ref, start.executor
                    continue
            if now - start.since > EXECUTOR_BACK_WITHIN_S:
                raise ExecutorLostError(
                    f"evaluation executor {start.executor} did not come back within "
                    f"{EXECUTOR_BACK_WITHIN_S:.0f} s of its death"
                )

    def poll(self, version: int, timeout_s: float = 0.0) -> list[dict[str, Any]]:
        """Rows of the rounds that have ended (waiting up to `timeout_s` for them), appended to eval.jsonl."""
        import ray

        rows: list[dict[str, Any]] = []
        deadline = time.monotonic() + timeout_s
        while True:
            for rnd in list(self.rounds):
                try:
                    self._start_lost_again(rnd)
                except ExecutorLostError as exc:  # an evaluation is an observation: training goes on
                    print(f"gyre-ray: warning: the evaluation round after step {rnd.step} is abandoned: {exc}",
                          file=sys.stderr, flush=True)  # fmt: skip
                    self._retire(rnd)
                    continue
                if len(rnd.ended) < len(rnd.refs):
                    continue
                outcomes = ray.get(rnd.refs)
                row = summarize(rnd.step, outcomes, self.cfg.run.eval_pass_threshold, rnd.version, version)
                self.run_dir.mkdir(parents=True, exist_ok=True)  # (the workspaces may be elsewhere)
                with open(self.run_dir / EVAL_FILE, "a") as handle:
                    handle.write(json.dumps(row) + "\n")
                self._retire(rnd)
                rows.append(row)
            waiting = [ref for rnd in self.rounds for ref in rnd.in_flight()]
            left = deadline - time.monotonic()
            if not self.rounds or left <= 0:
                return rows
            if any(s.probe is None for rnd in self.rounds for s in rnd.waiting.values()):
                left = min(left, RUNNER_PROBE_EVERY_S)  # a dead executor to ask again
            if waiting:
                ray.wait(waiting, num_returns=1, timeout=left)  # wakes at the next end (or loss)
            else:
                time.sleep(left)

    def _retire(self, rnd: _Round) -> None:
        """`rnd` is over (its row written, or abandoned): finish its executions, as a step finishes its
        own (through the proxy where given: the replica also forgets their caches and the cells their
        sessions; else in the store): records on file, keys revoked. Finishing one twice changes
        nothing. A failure is a warning: an evaluation is an observation, training goes on."""
        from gyre_ray.runtime.groups import finish_executions

        try:
            finish_executions(
                self.store, self.proxy, rnd.execution_ids(), timeout_s=60
            )  # (in the driver's poll)
        except Exception as exc:  # noqa: BLE001 - reported, the round's row (if any) is already written
            print(f"gyre-ray: warning: the executions of the evaluation round after step {rnd.step} were "
                  f"not finished (their keys may stay valid): {exc}", file=sys.stderr, flush=True)  # fmt: skip
        self.rounds.remove(rnd)
        self.done_steps.add(rnd.step)

    def finish(self, version: int, timeout_s: float = 3600.0) -> list[dict[str, Any]]:
        """Wait for every round under way; returns their rows."""
        return self.poll(version, timeout_s=timeout_s)


def reward_text(reward: float | None, digits: int = 3) -> str:
    """A mean reward for people: `n/a` when no execution was scored."""
    return "n/a" if reward is None else f"{reward:.{digits}f}"


def format_eval(row: dict[str, Any]) -> str:
    tasks = ", ".join(f"{t} {reward_text(f['reward'])}" for t, f in row["tasks"].items())
    reasons = row.get("drop_reasons") or {}
    issues = "; dropped: " + ", ".join(f"{k} x{n}" for k, n in sorted(reasons.items())) if reasons else ""
    return (
        f"eval of step {row['step']} (v{row['version']}): reward {reward_text(row['reward_mean'])}, pass rate "
        f"{row['pass_rate']:.2f} over {row['valid']}/{row['executions']} scored; per task: {tasks}{issues}"
    )
