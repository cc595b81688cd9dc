"""One elastic RL step on real Ray cells: the scheduler loop that applies the simulator's policy.

    proxy = start_elastic_proxy(cfg)                       # dual-role cells behind the proxy
    metrics = run_elastic_step(proxy, planned, cfg, workspaces, decode=tok.decode, vocab_size=args.vocab_size)

The loop (driver side, thin over Ray): build the policy's `SchedState` from its bookkeeping
(`gyre_ray.scheduling.runtime`), call the same policy object the simulator uses, apply its actions
(`Launch`: register the execution, start its harness task; `SwitchToTrain`: `proxy.drain` then
`to_training`; `SwitchToRollout`: after the cell's micro-step, a satellite exports its gradients to
the core, then `to_rollout` and `proxy.undrain`), and react to whatever finished first (an
execution, a switch, a micro-step). When a whole group of executions has ended its micro-batches
are built and put in the object store, on the streaming queue that free trainers claim from.
When every group is processed and every micro-batch trained, satellites' gradients are summed on
the core, scaled once by 1 / executions, the optimizer steps, and the new version goes to every
cell (trainers switch back); so every step ends with all cells rolling out the new weights.
"""

from __future__ import annotations

import dataclasses
import statistics
import time
from pathlib import Path
from typing import Any

from gyre_ray.agents.launch import PlannedExecution, run_planned_execution
from gyre_ray.agents.outcomes import outcome_metrics
from gyre_ray.agents.runner import Endpoint
from gyre_ray.elastic.stream import MicroBatchStream
from gyre_ray.observability.progress import Progress
from gyre_ray.scheduling.base import Policy
from gyre_ray.scheduling.runtime import (
    CellView,
    Costs,
    ExecutionLedger,
    build_state,
    migrate_executions,
    policy_from_section,
)
from gyre_ray.scheduling.state import Launch, Role, SwitchToRollout, SwitchToTrain


def cell_actors(proxy: Any) -> dict[str, Any]:
    """The cell actors behind a proxy handle, core first (cell ids in pool order)."""
    return proxy.cell_actors()


def run_elastic_step(
    proxy: Any,
    planned: list[PlannedExecution],
    cfg: Any,
    workspaces: Path,
    *,
    decode: Any,
    vocab_size: int,
    policy: Policy | None = None,
    costs: Costs | None = None,
    cells: dict[str, Any] | None = None,
    timeout_s: float = 3600.0,
) -> dict[str, Any]:
    """Roll out `planned` and train on it elastically; returns the step's metrics (incl. measured costs)."""
    step = _ElasticStep(proxy, cells or cell_actors(proxy), planned, cfg, workspaces, decode, vocab_size)
    return step.run(policy or policy_from_section(cfg.scheduler, len(step.ids)), costs or Costs(), timeout_s)


class _ElasticStep:
    def __init__(self, proxy, actors, planned, cfg, workspaces, decode, vocab_size) -> None:
        import ray

        self.ray = ray
        self.proxy, self.cfg, self.planned = proxy, cfg, planned
        self.workspaces, self.decode, self.vocab_size = Path(workspaces), decode, vocab_size
        self.ids = list(actors)
        self.actors = [actors[i] for i in self.ids]
        capacity = max(1, -(-cfg.agents.max_parallel // len(self.ids)))
        self.views = [CellView(cid, i, capacity=float(capacity)) for i, cid in enumerate(self.ids)]
        self.ledger = ExecutionLedger.planned(len(planned))
        self.stream = MicroBatchStream()
        self.version = int(ray.get(self.actors[0].trainer_version.remote(), timeout=60))
        self.start_weights = self.actors[0].state_dict.remote()  # one object for every satellite that joins
        self.tasks: dict[Any, int] = {}
        self.switches: dict[Any, tuple[int, str, float, dict]] = {}
        self.trains: dict[Any, tuple[int, int, float]] = {}
        self.imports: list[Any] = []
        self.has_grads = [False] * len(self.ids)
        self.outcomes: dict[int, Any] = {}
        self.groups: dict[str, list[int]] = {}
        for i, p in enumerate(planned):
            self.groups.setdefault(p.group, []).append(i)
        self.processed: set[str] = set()
        self.events: list[dict[str, Any]] = []
        self.micro_steps: list[float] = []
        self.losses: list[float] = []
        self.logprob_gap = 0.0  # largest |engine - trainer| log-prob on a loss token this step
        self.trees: list[dict[str, Any]] = []
        self.t0 = time.monotonic()

    # ---- the loop -------------------------------------------------------------------------------
    def run(self, policy: Policy, costs: Costs, timeout_s: float) -> dict[str, Any]:
        self.costs = costs
        for index, role in enumerate(policy.initial_roles(len(self.views))):
            if role is Role.TRAIN:
                self._switch_to_train(index)
        deadline = self.t0 + timeout_s
        with Progress("step", total=len(self.planned)) as progress:
            while True:
                if time.monotonic() > deadline:
                    raise TimeoutError(f"elastic step did not finish within {timeout_s:.0f} s")
                self._apply(policy)
                self._feed_trainers()
                if not self.stream.sealed and len(self.processed) == len(self.groups):
                    self.stream.seal()
                if self.stream.complete and not self.trains and not self.switches:
                    break
                refs = [*self.tasks, *self.switches, *self.trains]
                if not refs:
                    time.sleep(0.01)  # nothing in flight: the next decision hands out the work
                    continue
                ready, _ = self.ray.wait(refs, num_returns=1, timeout=1.0)
                if ready:
                    ready, _ = self.ray.wait(refs, num_returns=len(refs), timeout=0)
                for ref in ready:
                    self._finished(ref)
                progress.update(len(self.outcomes), note=self._progress_note())
        return self._finish()

    def _progress_note(self) -> str:
        training = sum(v.role is Role.TRAIN for v in self.views)
        trained = sum(self.stream.trained_by_cell().values())
        return (
            f"{len(self.tasks)} executions running, {training}/{len(self.views)} cells training, "
            f"{trained}/{len(self.stream.items)} micro-batches trained"
        )

    def _now(self) -> float:
        return time.monotonic() - self.t0

    def _apply(self, policy: Policy) -> None:
        state = build_state(
            self._now(), self.version, self.cfg.scheduler.staleness, self.views, self.ledger,
            self.stream.queued, self.costs,
        )  # fmt: skip
        for action in policy.decide(state):
            if isinstance(action, Launch):
                self._launch(action.exec_id, action.cell_id)
            elif isinstance(action, SwitchToTrain):
                self._switch_to_train(action.cell_id)
            elif isinstance(action, SwitchToRollout):
                view = self.views[action.cell_id]
                view.return_requested = True
                if view.ready and view.training_since is None:
                    self._start_return(action.cell_id)

    def _feed_trainers(self) -> None:
        for view in self.views:
            if (
                view.role is Role.TRAIN
                and view.ready
                and view.training_since is None
                and not view.return_requested
            ):
                item = self.stream.claim(view.cell_id)
                if item is None:
                    return
                ref = self.actors[view.index].train.remote(item.ref)
                self.trains[ref] = (view.index, item.index, time.perf_counter())
                view.training_since = self._now()

    def _finished(self, ref: Any) -> None:
        if ref in self.tasks:
            exec_id = self.tasks.pop(ref)
            self.outcomes[exec_id] = self.ray.get(ref)
            self.ledger.end(exec_id)
            group = self.planned[exec_id].group
            if all(e in self.outcomes for e in self.groups[group]):
                self._process_group(group)
        elif ref in self.switches:
            index, direction, started, event = self.switches.pop(ref)
            view = self.views[index]
            result = self.ray.get(ref)
            if direction == "to_rollout":
                t = time.perf_counter()
                self.proxy.undrain(view.cell_id)
                event["undrain_s"] = time.perf_counter() - t
            event.update(cell_seconds=result["seconds"], seconds=time.perf_counter() - started)
            self.events.append(event)
            self._measure(direction, event["seconds"])
            view.switching_since = None
            if direction == "to_training" and view.return_requested:
                self._start_return(index)
        else:
            index, item, started = self.trains.pop(ref)
            view = self.views[index]
            metrics = self.ray.get(ref)
            self.stream.trained(item, view.cell_id)
            self.has_grads[index] = True
            self.losses.append(metrics["loss"])
            self.logprob_gap = max(self.logprob_gap, metrics.get("logprob_gap_max", 0.0))
            self.micro_steps.append(time.perf_counter() - started)
            self.costs = dataclasses.replace(self.costs, micro_step_s=statistics.fmean(self.micro_steps))
            view.training_since = None
            if view.return_requested:
                self._start_return(index)

    # ---- actions --------------------------------------------------------------------------------
    def _launch(self, exec_id: int, cell: int) -> None:
        item = self.planned[exec_id]
        key = self.proxy.register_execution(item.execution_id, {"task_id": item.task.task_id})["api_key"]
        remote = self.ray.remote(num_cpus=0)(run_planned_execution)
        ref = remote.remote(
            item.execution_id, self.cfg.agents.task_set, item.task.task_id, Endpoint(self.proxy.base_url, key),
            str(self.workspaces / item.execution_id), self.cfg.agents.model_dump(),
        )  # fmt: skip
        self.tasks[ref] = exec_id
        self.ledger.launch(exec_id, cell, self._now())

    def _switch_to_train(self, index: int) -> None:
        view = self.views[index]
        running = len(self.ledger.hosted)
        moved = migrate_executions(self.ledger, index, self.views)
        view.role, view.switching_since, view.return_requested = Role.TRAIN, self._now(), False
        started = time.perf_counter()
        migrated = self.proxy.drain(view.cell_id)
        weights = None if index == 0 else self.start_weights
        ref = self.actors[index].to_training.remote(weights, self.version)
        self.switches[ref] = (index, "to_training", started, {
            "cell": view.cell_id, "direction": "rollout->train", "at_s": round(self._now(), 3),
            "executions_running": running, "executions_rehosted": len(moved),
            "requests_migrated": migrated, "drain_s": time.perf_counter() - started,
        })  # fmt: skip

    def _start_return(self, index: int, weights: Any = None, version: int | None = None) -> None:
        view = self.views[index]
        actor = self.actors[index]
        if index != 0 and self.has_grads[index]:  # a satellite's sum moves to the core before it leaves
            self.imports.append(self.actors[0].import_grads.remote(actor.export_grads.remote()))
            self.has_grads[index] = False
        if weights is None and index != 0:
            weights = self.start_weights
        view.role, view.switching_since, view.return_requested = Role.ROLLOUT, self._now(), False
        ref = actor.to_rollout.remote(weights, self.version if version is None else version)
        self.switches[ref] = (index, "to_rollout", time.perf_counter(), {
            "cell": view.cell_id, "direction": "train->rollout", "at_s": round(self._now(), 3),
            "executions_running": len(self.ledger.hosted),
        })  # fmt: skip

    def _measure(self, direction: str, seconds: float) -> None:
        times = [e["seconds"] for e in self.events if e["direction"] == self.events[-1]["direction"]]
        name = "switch_to_train_s" if direction == "to_training" else "switch_to_rollout_s"
        self.costs = dataclasses.replace(self.costs, **{name: statistics.fmean(times or [seconds])})

    def _process_group(self, group: str) -> None:
        """A whole group has ended: records -> trees -> micro-batches, each put in the object store."""
        from gyre_ray.trajectory.pipeline import training_batches_with_stats

        outcomes = [self.outcomes[e] for e in self.groups[group]]
        valid = [o for o in outcomes if o.valid]
        records = {o.execution_id: self.proxy.records(o.execution_id) for o in valid}
        for o in outcomes:
            self.proxy.finish_execution(o.execution_id)
        rewards = {o.execution_id: o.reward for o in valid}
        groups = {e: group for e in records}
        batches, trees = training_batches_with_stats(
            records, rewards, groups, self.cfg, decode=self.decode, vocab_size=self.vocab_size
        )
        self.trees.extend(trees)
        for batch in batches:
            self.stream.put(self.ray.put(batch), batch.meta.get("execution_ids", []))
        self.processed.add(group)

    # ---- the end of the step --------------------------------------------------------------------
    def _finish(self) -> dict[str, Any]:
        ray, core = self.ray, self.actors[0]
        for index, view in enumerate(self.views):
            if index and view.role is Role.TRAIN and self.has_grads[index]:
                self.imports.append(core.import_grads.remote(self.actors[index].export_grads.remote()))
                self.has_grads[index] = False
        ray.get(self.imports, timeout=600)
        step_metrics: dict[str, Any] = {}
        new_version = self.version
        if self.stream.items:
            step_metrics = ray.get(core.optimizer_step.remote(self.stream.scale()), timeout=600)
            new_version = int(step_metrics["version"])
        weights = core.state_dict.remote()  # the new version: one object, every cell pulls it
        updates = []
        for index, view in enumerate(self.views):
            if view.role is Role.TRAIN:
                self._start_return(index, weights, new_version)
            else:
                updates.append(self.actors[index].update_weights.remote(weights, new_version))
        while self.switches:
            ready, _ = ray.wait(list(self.switches), num_returns=1, timeout=600)
            if not ready:
                raise TimeoutError("cells did not switch back to rollout within 600 s")
            self._finished(ready[0])
        ray.get(updates, timeout=600)
        return self._metrics(step_metrics, new_version)

    def _metrics(self, step_metrics: dict[str, Any], version: int) -> dict[str, Any]:
        outcomes = list(self.outcomes.values())
        rewards = [o.reward for o in outcomes if o.valid]
        trees = self.trees
        metrics: dict[str, Any] = {
            "executions": len(outcomes),
            "valid": sum(o.valid for o in outcomes),
            "timed_out": sum(o.timed_out for o in outcomes),
            "reward_mean": statistics.fmean(rewards) if rewards else 0.0,
            "calls": sum(t["calls"] for t in trees),
            "paths_total": sum(t["paths_total"] for t in trees),
            "paths_selected": sum(t["paths_selected"] for t in trees),
            "tokens_expanded_all": sum(t["tokens_expanded_all"] for t in trees),
            "tokens_packed_selected": sum(t["tokens_packed_selected"] for t in trees),
            "loss_tokens": sum(t["loss_tokens_selected"] for t in trees),
            "micro_batches": len(self.stream.items),
            "trained_by_cell": self.stream.trained_by_cell(),
            "switches": self.events,
            "step_seconds": time.monotonic() - self.t0,
            "costs": dataclasses.asdict(self.costs),
            "version": version,
            **outcome_metrics(outcomes),  # dropped executions and every reason, per execution
        }
        if step_metrics:
            metrics.update(
                loss=sum(self.losses),
                grad_norm=step_metrics.get("grad_norm"),
                logprob_gap_max=self.logprob_gap,
            )
        else:
            metrics["skipped"] = "no executions with model-generated tokens"
        return metrics
