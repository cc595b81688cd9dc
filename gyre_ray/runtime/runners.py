"""Where executions run: the run's `workers` actor beside the scheduler, or runner actors of their own.

An agent execution spends hours in its tools (builds, test runs) on the CPUs of the machine its
harness runs on. With `agents.runners = 0` every harness runs in `workers` on the control node; with
N > 0 the runtime starts N `RunWorkers` actors named `runner-0` .. `runner-<N-1>` in the run's
namespace, spread over the nodes that offer `agents.runner_resources` (say CPU-only pods started with
`--resources '{"agents": 1}'`), and the scheduler puts each execution on the runner with the fewest
running (`least_loaded`), journaling which, so a restarted scheduler asks that runner for its outcome.

A runner that dies (its node lost, its process killed; Ray starts it again, on another node if its
node is gone) takes its executions' harnesses with it, and so does `workers` (Ray starts it again
too). `RunnerRecovery` (a part of `RunScheduler`) starts each of them again from the beginning, on
another runner where there is one, under a new id (`r1.<id>`, ...): the lost harness's records stay
in the store under the old id, its key revoked, and are never trained on; the group's training waits
for the new execution as for any other. An execution started `MAX_STARTS` times stops the run.
While every executor it could start on is known dead (say `workers`, with no runners, while Ray
starts it again), the new start waits, and so does a group job `workers` died processing: the
scheduler loop goes on deciding, asks the dead executor again every `RUNNER_PROBE_EVERY_S`, and
sends what waited once it answers.

A runner on another node reaches the proxy over the network: `runner_base_url` gives it the proxy's
node address where the proxy listens on every interface (`proxy.host=0.0.0.0`), and refuses a proxy
bound to loopback, which such a runner cannot reach.
"""

from __future__ import annotations

import dataclasses
import time
from collections import Counter
from collections.abc import Iterable
from typing import Any
from urllib.parse import urlsplit, urlunsplit

from gyre_ray.agents.config import AgentSection
from gyre_ray.agents.relaunch import relaunch_id, starts_of
from gyre_ray.config import ConfigError

WORKERS_NAME = "workers"  # the run's own executor beside the scheduler (`gyre_ray.runtime.workers`)
RUNNER_PREFIX = "runner-"
_LOOPBACK = ("127.0.0.1", "localhost", "::1")
_EVERY_INTERFACE = ("0.0.0.0", "::")


def runner_name(index: int) -> str:
    """The named actor of runner `index` (`runner-0`, ...)."""
    return f"{RUNNER_PREFIX}{index}"


def start_runners(section: AgentSection, namespace: str, lifetime: str | None, timeout_s: float) -> list[Any]:
    """`section.runners` runner actors, spread over the nodes offering `section.runner_resources`,
    each placed and answering within `timeout_s` (else a ConfigError naming what no node offers)."""
    import ray

    from gyre_ray.runtime.workers import RunWorkers

    runners = [
        RunWorkers.options(
            name=runner_name(index),
            namespace=namespace,
            resources=dict(section.runner_resources) or None,
            scheduling_strategy="SPREAD",
            lifetime=lifetime,
            max_restarts=-1,  # a dead runner comes back (elsewhere, if its node is gone) for later executions
        ).remote()
        for index in range(section.runners)
    ]
    _, pending = ray.wait([r.node_ip.remote() for r in runners], num_returns=len(runners), timeout=timeout_s)
    if pending:
        for runner in runners:
            ray.kill(runner, no_restart=True)
        wanted = section.runner_resources or {"CPU": 0}
        raise ConfigError(
            f"{len(pending)} of agents.runners={section.runners} runner actors could not be placed within "
            f"{timeout_s:.0f} s: no node offered {wanted} for them (start the agent nodes with "
            "`ray start --resources ...`, or lower agents.runners)"
        )
    return runners


def least_loaded(running: Iterable[int], count: int, avoid: Iterable[int] = ()) -> int:
    """The runner (0 .. count - 1) with the fewest of `running` (each a running execution's runner),
    among those not in `avoid` while any is left (runners that died: Ray may still be restarting them)."""
    load, avoided = Counter(running), set(avoid)
    choices = [index for index in range(count) if index not in avoided] or list(range(count))
    return min(choices, key=lambda index: (load[index], index))


MAX_STARTS = 5  # starts of one planned execution (its first and each after its executor died)


def executor_name(runner: int | None) -> str:
    """The named actor an execution runs in: `runner-<i>`, or `workers` (runner None)."""
    return WORKERS_NAME if runner is None else runner_name(runner)


class ExecutorLostError(RuntimeError):
    """An execution's executor died under it `MAX_STARTS` times, or did not come back: the run stops."""


def check_starts(execution_id: str, executor: str) -> None:
    """ExecutorLostError once `execution_id` has been started `MAX_STARTS` times (its executor, named
    `executor`, died under it each time), rather than start it again."""
    if starts_of(execution_id) >= MAX_STARTS:
        raise ExecutorLostError(
            f"execution {execution_id} lost its executor ({executor}) {MAX_STARTS} times; "
            "the run stops rather than start it again (see the actor's log in the Ray dashboard)"
        )


def register_again(store: Any, execution_id: str, metadata: dict[str, Any], executor: str) -> tuple[str, str]:
    """The id (`relaunch_id`) and API key under which `execution_id`, whose executor (named `executor`)
    died under it, starts again (`check_starts` first): the old id's key is revoked (a harness that
    lives on adds nothing) and its records, if any, stay in the store under it, never trained on."""
    import ray

    check_starts(execution_id, executor)
    store.finish_execution.remote(execution_id)
    again = relaunch_id(execution_id)
    while True:
        registered = store.register.remote(again, {**metadata, "relaunch_of": execution_id})
        try:
            return again, ray.get(registered, timeout=60)["api_key"]
        except Exception as exc:
            # registered by a scheduler that died before it journaled the launch: that id is spent
            # (its harness, if it started, has its key revoked here) and the next one is taken
            if "already registered" not in str(exc) or starts_of(again) >= MAX_STARTS:
                raise
            store.finish_execution.remote(again)
            again = relaunch_id(again)


EXECUTOR_BACK_WITHIN_S = 300.0  # an executor that died and is not back after this stops the run


def wait_until_answering(actor: Any, name: str, timeout_s: float = EXECUTOR_BACK_WITHIN_S) -> str:
    """Block until executor `actor` answers (Ray restarting it after a death: a call sent before the
    new process is up fails too, which would cost an execution a start); returns its node's address;
    ExecutorLostError after `timeout_s`."""
    import ray
    from ray.exceptions import GetTimeoutError, RayActorError

    deadline = time.monotonic() + timeout_s
    while True:
        try:
            return ray.get(actor.node_ip.remote(), timeout=max(1.0, deadline - time.monotonic()))
        except (RayActorError, GetTimeoutError) as exc:
            if time.monotonic() >= deadline:
                raise ExecutorLostError(
                    f"{name} did not come back within {timeout_s:.0f} s ({exc})"
                ) from None
            time.sleep(0.2)


def node_ips(actors: list[Any], names: list[str], timeout_s: float = EXECUTOR_BACK_WITHIN_S) -> list[str]:
    """The node address of each executor in `actors` (named `names`), asked of all at once; one that
    Ray is restarting is waited for (`wait_until_answering`), all within `timeout_s`."""
    import ray
    from ray.exceptions import GetTimeoutError, RayActorError

    deadline = time.monotonic() + timeout_s
    refs = [actor.node_ip.remote() for actor in actors]
    ips = []
    for actor, name, ref in zip(actors, names, refs, strict=True):
        left = max(1.0, deadline - time.monotonic())
        try:
            ips.append(ray.get(ref, timeout=left))
        except (RayActorError, GetTimeoutError):
            ips.append(wait_until_answering(actor, name, max(1.0, deadline - time.monotonic())))
    return ips


RUNNER_PROBE_EVERY_S = 1.0  # how often an executor known dead is asked whether Ray has it back


class RunnerRecovery:
    """Executions whose executor (a runner actor or `workers`) died, started again (a part of `RunScheduler`).

    An executor that died is in `lost_runners` (a runner's index; None: `workers`) until it answers
    again (`_probe_lost_runners`): a runner is left out of the choice meanwhile, and a start that
    has no executor left to go to waits in `waiting_starts` (a group job in `waiting_groups`), so
    the scheduler loop never blocks on Ray restarting an actor."""

    def _executor(self, runner: int | None) -> Any:
        """The actor of runner `runner` (None: `workers`)."""
        return self.workers if runner is None else self.runners[runner]

    def _probe_lost_runners(self) -> None:
        """Ask each executor known dead, at most every `RUNNER_PROBE_EVERY_S`, whether it is back;
        ExecutorLostError once work has waited `EXECUTOR_BACK_WITHIN_S` for one that is not."""
        now = time.monotonic()
        for runner in self.lost_runners:
            self.lost_at.setdefault(runner, now)
        waited_for = [None] if self.waiting_groups and None in self.lost_runners else []
        if self.waiting_starts and self.lost_runners:  # (they wait while every executor is down)
            waited_for.append(max(self.lost_runners, key=lambda r: self.lost_at[r]))
        for runner in waited_for:
            if now - self.lost_at[runner] > EXECUTOR_BACK_WITHIN_S:
                raise ExecutorLostError(
                    f"{executor_name(runner)} did not come back within {EXECUTOR_BACK_WITHIN_S:.0f} s of its "
                    "death; the run stops (see the actor's log in the Ray dashboard)"
                )
        asked = set(self.runner_probes.values())
        for runner in self.lost_runners - asked:
            if self.runner_probe_due.get(runner, 0.0) <= now:
                self.runner_probes[self._executor(runner).node_ip.remote()] = runner

    def _runner_probed(self, ref: Any, runner: int | None) -> None:
        import ray
        from ray.exceptions import RayActorError

        try:
            ray.get(ref, timeout=0)
        except RayActorError:  # still down (or restarting): ask again later
            self.runner_probe_due[runner] = time.monotonic() + RUNNER_PROBE_EVERY_S
            return
        self.lost_runners.discard(runner)
        self.lost_at.pop(runner, None)
        self._start_waiting()
        if runner is None:
            waiting, self.waiting_groups = self.waiting_groups, []
            for job in waiting:
                self._submit_group(job)

    def _runner_lost(self, run: Any) -> None:
        """The executor of execution `run` died with it in flight (`run.runner`; None: `workers`): start
        it again from the beginning, on another runner where there is one, under a new id and key."""
        lost_id, lost_runner = self.planned[run.exec_id].execution_id, run.runner
        self.lost_runners.add(lost_runner)
        started = self._start_again(run)
        loss = {"runner": lost_runner, "actor": executor_name(lost_runner), "execution": lost_id,
                "relaunched_as": self.planned[run.exec_id].execution_id,
                "on_runner": run.runner if started else "waiting", "at_s": round(self._now(), 3)}  # fmt: skip
        self.runner_losses.append(loss)
        self.journal.runner_lost(loss)  # a restarted scheduler's result still lists it

    def _start_again(self, run: Any) -> bool:
        """Start planned execution `run`, whose executor (`run.runner`) lost it, afresh under a new id,
        key and workspace (`register_again`: at most `MAX_STARTS` starts). False: every executor it
        could go to is known dead, and it waits for one to answer (`_start_waiting`)."""
        item = self.planned[run.exec_id]
        again, key = register_again(
            self.store, item.execution_id, {"task_id": item.task.task_id}, executor_name(run.runner)
        )
        self.planned[run.exec_id] = dataclasses.replace(item, execution_id=again)
        self.waiting_starts.append((run, key))
        self._start_waiting()
        return all(waiting is not run for waiting, _ in self.waiting_starts)

    def _start_waiting(self) -> None:
        """Start each execution of `waiting_starts` on the least loaded executor not known dead; while
        every one is (Ray restarting them: a call would fail and cost the execution a start), it waits."""
        waiting, self.waiting_starts = self.waiting_starts, []
        for run, key in waiting:
            runner = self._pick_runner()
            if runner in self.lost_runners:
                self.waiting_starts.append((run, key))
                continue
            item = self.planned[run.exec_id]
            ref, run.runner = self._start_execution(item, key, runner)
            self.running[ref] = run
            self.recorder.ran_on(run.exec_id, executor_name(run.runner))
            self.journal.launched(
                run.exec_id, run.cell, at_s=run.since, execution_id=item.execution_id, group=item.group,
                step=self.ledger.batch_of[run.exec_id], version=run.version, runner=run.runner,
            )  # fmt: skip


def runner_base_url(base_url: str, proxy_host: str, proxy_ip: str, runner_ips: list[str]) -> str:
    """The proxy's URL as the runners reach it: `base_url` where they share its node; else the proxy's
    node address `proxy_ip` (it must then listen on every interface or on a routable address)."""
    if all(ip == proxy_ip for ip in runner_ips):
        return base_url
    away = sorted({runner_name(i) for i, ip in enumerate(runner_ips) if ip != proxy_ip})
    if proxy_host in _LOOPBACK:
        raise ConfigError(
            f"{', '.join(away)} run on other nodes than the proxy ({proxy_ip}), which listens on "
            f"{proxy_host} only: set proxy.host=0.0.0.0 so that their executions can reach it"
        )
    if proxy_host not in _EVERY_INTERFACE:
        return base_url  # a routable address of its own
    parts = urlsplit(base_url)
    netloc = f"[{proxy_ip}]" if ":" in proxy_ip else proxy_ip
    return urlunsplit(parts._replace(netloc=f"{netloc}:{parts.port}"))
