"""The run's warm worker: executions' harness runners and group processing, as actor tasks in one process.

A Ray task per execution would start a fresh worker process whenever the idle ones were reaped (Ray
keeps about one idle worker per CPU), and each start imports the whole stack again; on a small
machine that costs more CPU than the agents. `RunWorkers` (the named actor `workers`, no CPU
reserved, threaded) runs each harness runner (it mostly waits on its subprocess or the model) and
each group's processing (`gyre_ray.runtime.groups.process_group`, reading the store) in a thread of
one long-lived process, with the tokenizer loaded once.

It remembers each execution's outcome (`outcome_of`): the actor is not the scheduler's (the
runtime starts it), so its harness threads go on when the scheduler actor dies, and the restarted
scheduler collects what they return (`gyre_ray.runtime.reattach`). As it starts, it ends the
harnesses that a dead executor on its node left running (`reap_orphans`: their slots' flocks died
with that process; they did not).
"""

from __future__ import annotations

import logging
import threading
from collections import OrderedDict
from typing import Any

import ray

from gyre_ray.agents.sandbox import reap_orphans
from gyre_ray.recent import put_recent
from gyre_ray.runtime.groups import GroupResult, process_group

log = logging.getLogger(__name__)
OUTCOMES_KEPT = 100_000  # outcomes of ended executions remembered (a few hundred bytes each)


@ray.remote(num_cpus=0, max_concurrency=512)
class RunWorkers:
    """Threads for executions and group processing (each call is one actor task with its own ref)."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._running: dict[str, threading.Event] = {}
        self._ended: OrderedDict[str, tuple[bool, Any]] = OrderedDict()  # id -> (raised, outcome or error)
        try:  # harnesses a dead executor on this node left running (Ray restarting this one, say)
            if reaped := reap_orphans():
                log.warning("ended the harnesses a dead executor left running as %s", ", ".join(reaped))
        except Exception as exc:  # noqa: BLE001 - a start must not fail on it: the slot's next holder ends them
            log.warning("could not end the harnesses a dead executor left: %s", exc)

    def node_ip(self) -> str:
        """The address of the node this actor runs on."""
        return ray.util.get_node_ip_address()

    def execute(self, execute: Any, *args: Any, **kwargs: Any) -> Any:
        """One execution: `execute(*args, **kwargs)` (`run_planned_execution`'s signature; args[0] is its id)."""
        execution_id = str(args[0])
        with self._lock:
            done = self._running[execution_id] = threading.Event()
        try:
            outcome = execute(*args, **kwargs)
        except BaseException as exc:
            self._remember(execution_id, (True, exc), done)
            raise
        self._remember(execution_id, (False, outcome), done)
        return outcome

    def outcome_of(self, execution_id: str, timeout_s: float = 86_400.0) -> Any:
        """The outcome of execution `execution_id`, once it ends (it raises what the execution raised);
        None when this actor never started it."""
        with self._lock:
            ended = self._ended.get(execution_id)
            done = self._running.get(execution_id)
        if ended is None and done is None:
            return None
        if ended is None:
            if not done.wait(timeout_s):
                raise TimeoutError(f"execution {execution_id} did not end within {timeout_s:.0f} s")
            ended = self._ended[execution_id]
        raised, value = ended
        if raised:
            raise value
        return value

    def _remember(self, execution_id: str, ended: tuple[bool, Any], done: threading.Event) -> None:
        with self._lock:
            put_recent(self._ended, execution_id, ended, OUTCOMES_KEPT)
            if self._running.get(execution_id) is done:
                del self._running[execution_id]
        done.set()

    def process_group(
        self,
        store: Any,
        group: str,
        outcomes: list[dict[str, Any]],
        cfg_json: dict[str, Any],
        proxy: dict[str, str] | None = None,
    ) -> GroupResult:
        """Records of a finished group (read from `store`) -> micro-batches and figures."""
        return process_group(store, group, outcomes, cfg_json, proxy)
