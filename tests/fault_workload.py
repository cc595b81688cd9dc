"""Test-only agent workload for fault tests: a fixed number of model calls per execution, counted.

`CountingExecutor` has `run_planned_execution`'s signature. Each execution makes `calls` chat calls
through the proxy (each re-sending the conversation so far), sleeping `tool_s` between them, and
retries a 429/503 after its Retry-After as a harness would (and a stream that ends in an error
event, a proxy replica killed mid-call); it never gives up on a retryable error before `deadline_s`.
Its outcome carries how many calls got a 200 (`calls`, also written to the workspace as
`counted.json`), so a test compares that with the records the store kept. Rewards differ within a
group (the execution's index in it), so the update has gradients to compare.
"""

from __future__ import annotations

import json
import time
import zlib
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from longtail_workload import register_by_value

from gyre_ray.trajectory.records import read_jsonl


def fault_overrides(cells: int, capacity: int) -> list[str]:
    """The fault tests' job: `cells` tiny-model cells, 2 tasks x 2 samples a step, float64 weights (the
    update is compared at 1e-6: float32 sums taken in another order already differ by ~1e-6)."""
    return [
        f"cells.num_cells={cells}", "cells.cpus_per_cell=0.5", f"cells.capacity={capacity}", "proxy.port=0",
        "proxy.queue_timeout_s=5", "run.tasks_per_step=2", "algo.group_size=2", "agents.timeout_s=300",
        "trainer.lr=1e-3", "model.dtype=float64", "trajectory.row_tokens=64", "trajectory.micro_batch_tokens=64",
    ]  # fmt: skip


@dataclass
class CountingExecutor:
    """`calls` model calls of `max_tokens` each, `tool_s` apart (picklable; Ray ships it by value)."""

    calls: int = 4
    max_tokens: int = 24
    tool_s: float = 0.3
    deadline_s: float = 300.0
    stream: bool = True  # streamed calls: tokens reach the proxy as generated (a dead cell's are kept)
    seed: int | None = None  # seeded sampling: call j of an execution sends seed + 1000 * crc32(id) + j, so
    # (id: the planned one, so an execution started again after its executor died draws the same tokens)
    # two runs of the same job draw the same tokens (what a fault-free vs faulty comparison needs)

    def __call__(
        self,
        execution_id: str,
        task_set: str,
        task_id: str,
        endpoint: Any,
        workspace: str,
        section: dict[str, Any],
        run_seed: int = 0,  # the fake draws from its own seed
    ) -> Any:
        import httpx

        from gyre_ray.agents.relaunch import planned_id
        from gyre_ray.agents.runner import ExecutionOutcome

        Path(workspace).mkdir(parents=True, exist_ok=True)
        started = time.monotonic()
        messages = [
            {"role": "system", "content": "You are a coding agent."},
            {"role": "user", "content": f"task {task_id}"},
        ]
        headers = {"Authorization": f"Bearer {endpoint.api_key}"}
        ok = retried = 0
        planned = planned_id(execution_id)
        seed = None if self.seed is None else self.seed + zlib.crc32(planned.encode()) * 1000
        with httpx.Client(base_url=endpoint.base_url, headers=headers, timeout=120.0) as client:
            for _ in range(self.calls):
                while True:
                    body = {"model": "policy", "messages": messages, "max_tokens": self.max_tokens}
                    if seed is not None:
                        body["seed"] = seed + ok
                    reply = client.post("/v1/chat/completions", json={**body, "stream": self.stream})
                    if reply.status_code in (429, 503) and time.monotonic() - started < self.deadline_s:
                        retried += 1
                        time.sleep(float(reply.headers.get("retry-after", "1")))
                        continue
                    reply.raise_for_status()
                    if self.stream and stream_failed(reply.text):  # a replica died mid-stream: retry
                        retried += 1
                        time.sleep(1.0)
                        continue
                    break
                ok += 1
                text = (
                    streamed_text(reply.text)
                    if self.stream
                    else reply.json()["choices"][0]["message"]["content"]
                )
                text = text or ""
                messages += [{"role": "assistant", "content": text}, {"role": "user", "content": "tool: ok"}]
                time.sleep(self.tool_s)
        # what the harness saw, beside its work (a benchmark reads it when no trace row is left)
        (Path(workspace) / "counted.json").write_text(json.dumps({"calls": ok, "retried": retried}))
        index = int(execution_id.rsplit("-", 1)[-1])
        return ExecutionOutcome(
            execution_id=execution_id,
            task_id=task_id,
            exit_code=0,
            timed_out=False,
            duration_s=time.monotonic() - started,
            reward=float(index % 2),
            valid=True,
            detail=f"calls={ok} retried={retried}",
            log_tail="",
            calls=ok,
        )


def streamed_text(body: str) -> str:
    """The content of an OpenAI chat-completions event stream."""
    parts = []
    for line in body.splitlines():
        if line.startswith("data: ") and line != "data: [DONE]":
            for choice in json.loads(line[6:]).get("choices", []):
                parts.append(choice.get("delta", {}).get("content") or "")
    return "".join(parts)


def stream_failed(body: str) -> bool:
    """True when an event stream carries an error event (the call did not complete)."""
    return any(line.startswith("data: {") and "error" in json.loads(line[6:]) for line in body.splitlines())


def wait_for_calls(rt: Any, run_ref: Any, calls: int, timeout_s: float = 300.0) -> None:
    """Until the store holds `calls` records (the step still running)."""
    import ray

    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        assert not ray.wait([run_ref], timeout=0)[0], "the step ended before the fault"
        if ray.get(rt.store.stats.remote(), timeout=30)["records"] >= calls:
            return
        time.sleep(0.05)
    raise AssertionError("the executions made no calls")


def check_nothing_lost(folder, result: dict, executions: int, calls: int) -> int:
    """Every execution ended valid with all its `calls` 200-answered calls recorded (a harness that
    got no 200 raises, which would fail the run); returns how many calls were re-prefilled."""
    trace = result["trace"]
    assert len(trace) == executions
    reprefilled = 0
    for row in trace:
        exec_id = row["exec_id"]
        records = read_jsonl(folder / "records" / f"{exec_id}.jsonl")
        assert not row["dropped"], row
        assert len(records) == row["calls"] == calls, (exec_id, len(records), row)
        for record in records:
            assert len(record.output_ids) == len(record.output_logprobs) == len(record.versions) > 0
            reprefilled += record.meta.get("reprefills", 0)
    return reprefilled


def weight_distance(a: dict, b: dict) -> float:
    """The L2 distance between two state dicts of the same keys (float64)."""
    return sum(float(((a[k].double() - b[k].double()) ** 2).sum()) for k in b) ** 0.5


def relative_update_gap(start: dict, final: dict, reference: dict) -> float:
    update = weight_distance(reference, start)
    assert update > 0, "the reference update is zero: nothing to compare"
    return weight_distance(final, reference) / update


def reference_weights(rt: Any, start: dict, version: int, batches: list) -> dict:
    """The update of `batches` on one fault-free trainer from `start` (the single-trainer loop)."""
    from gyre_ray.algo.gspo import step_scale
    from gyre_ray.runtime.cluster import trainer_factory_for

    trainer = trainer_factory_for(rt.config)()
    trainer.load_state_dict(start, version)
    for batch in batches:
        trainer.forward_backward(batch)
    trainer.optimizer_step(step_scale(batches))
    return trainer.state_dict()


def ship_by_value() -> None:
    """Ship this module's classes to Ray workers by value."""
    register_by_value(__name__)
