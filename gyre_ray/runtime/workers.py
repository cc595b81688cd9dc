"""The run's warm worker: executions' harness runners and group processing, as actor tasks in one process.

A Ray task per execution would start a fresh worker process whenever the idle ones were reaped (Ray
keeps about one idle worker per CPU), and each start imports the whole stack again; on a small
machine that costs more CPU than the agents. `RunWorkers` (the named actor `workers`, no CPU
reserved, threaded) runs each harness runner (it mostly waits on its subprocess or the model) and
each group's processing (`gyre_ray.runtime.groups.process_group`, reading the store) in a thread of
one long-lived process, with the tokenizer loaded once.
"""

from __future__ import annotations

from typing import Any

import ray

from gyre_ray.runtime.groups import GroupResult, process_group

WORKERS_NAME = "workers"


@ray.remote(num_cpus=0, max_concurrency=512)
class RunWorkers:
    """Threads for executions and group processing (each call is one actor task with its own ref)."""

    def execute(self, execute: Any, *args: Any) -> Any:
        """One execution: `execute(*args)` (`run_planned_execution`'s signature)."""
        return execute(*args)

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
