"""The same one-step job through each weights/gradients backend: it runs end to end on every one, and the
first update (the core's weights after its optimizer step) is the same whichever backend carried the
weights and the gradients.

One `Runtime` for the module (two tiny-model dual-role cells in float64, the scheduler actor, eta 0,
`colocate` so that both cells train, one task of two executions); before each backend's job every
cell switches its transports (`use_transfer`) and the core is restored to the same first checkpoint. The executions
are deterministic: a fixed number of calls, each sampled with a seed of its own (`SeededExecutor`),
so every job trains the same micro-batches, and the test checks that it did before comparing the
updates. Then, on the collectives job: a cell restarted after a fault missed that broadcast, so it
rejoins through the object store (logged, counted), and the next version's group has it again.
"""

from __future__ import annotations

import os
import time
import zlib
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest
import ray
import torch
from fault_workload import reference_weights, relative_update_gap
from local_ray import private_ray, toy_runtime
from longtail_workload import register_by_value
from test_transfer import _kill_and_wait

from gyre_ray.runtime.cluster import Runtime
from gyre_ray.transfer.mooncake import mooncake_available

pytestmark = pytest.mark.slow

MOONCAKE_OK, MOONCAKE_WHY = mooncake_available()
BACKENDS = [
    "collective",  # first: the runtime starts with it, so a restarted cell gets it too
    "object_store",
    pytest.param(
        "mooncake",
        marks=pytest.mark.skipif(
            not MOONCAKE_OK and os.environ.get("CI") != "true", reason=f"Mooncake cannot load: {MOONCAKE_WHY}"
        ),
    ),
]
OVERRIDES = [
    "cells.num_cells=2",
    "cells.cpus_per_cell=0.5",
    "cells.capacity=2",
    "proxy.port=0",
    "run.tasks_per_step=1",
    "algo.group_size=2",
    "agents.timeout_s=120",
    "trainer.lr=1e-3",
    "model.dtype=float64",  # float32 sums in another order differ by ~1e-6: compare the bytes' effect only
    "trajectory.row_tokens=32",
    "trajectory.micro_batch_tokens=32",  # several micro-batches: both cells train, gradients move
    "transfer.verify_checksums=true",
    "transfer.weights=collective",
    "transfer.gradients=collective",
]


@dataclass
class SeededExecutor:
    """`calls` chat calls of `max_tokens` each, every one with its own sampling seed (picklable)."""

    calls: int = 2
    max_tokens: int = 12

    def __call__(
        self, execution_id: str, task_set: str, task_id: str, endpoint: Any, workspace: str, *_, **__
    ) -> Any:  # the agents section and run_seed are not needed: the fake samples by execution id alone
        import httpx

        from gyre_ray.agents.runner import ExecutionOutcome

        Path(workspace).mkdir(parents=True, exist_ok=True)
        started = time.monotonic()
        messages = [{"role": "user", "content": f"task {task_id}"}]
        headers = {"Authorization": f"Bearer {endpoint.api_key}"}
        plain = execution_id.split(".", 1)[-1]  # without the run's tag: every run samples the same
        with httpx.Client(base_url=endpoint.base_url, headers=headers, timeout=120.0) as client:
            for call in range(self.calls):
                body = {"model": "policy", "messages": messages, "max_tokens": self.max_tokens,
                        "temperature": 1.0, "seed": zlib.crc32(f"{plain}/{call}".encode())}  # fmt: skip
                while (reply := client.post("/v1/chat/completions", json=body)).status_code in (429, 503):
                    time.sleep(float(reply.headers.get("retry-after", "1")))
                reply.raise_for_status()
                text = reply.json()["choices"][0]["message"]["content"] or ""
                messages += [{"role": "assistant", "content": text}, {"role": "user", "content": "tool: ok"}]
        index = int(execution_id.rsplit("-", 1)[-1])
        return ExecutionOutcome(execution_id, task_id, 0, False, time.monotonic() - started,
                                float(index % 2), True, "", "", calls=self.calls)  # fmt: skip


@pytest.fixture(scope="module")
def job(tmp_path_factory):
    """One runtime for the module (starting one per backend costs minutes here) and its first checkpoint."""
    from gyre_ray.checkpoint import trainer_dir

    register_by_value(__name__)
    with private_ray():
        folder = tmp_path_factory.mktemp("job")
        rt = toy_runtime(folder, OVERRIDES, SeededExecutor())
        checkpoint = folder / "start"
        ray.get(rt.core.save.remote(str(trainer_dir(checkpoint))), timeout=120)
        yield rt, checkpoint
        rt.shutdown()


JOBS: dict[str, dict[str, Any]] = {}  # backend -> what its job left (weights after the update, batches)


def _tokens(batches: list) -> list[list[int]]:
    return [b.input_ids.reshape(-1).tolist() for b in batches]


def _status(rt: Runtime, cell_id: str) -> dict:
    return ray.get(ray.get_actor(cell_id, namespace=rt.namespace).status.remote(), timeout=60)


def _run(rt: Runtime, tag: str) -> dict:
    """One step under `colocate` (every cell trains: gradients move) at eta 0."""
    section = {"policy": "colocate", "staleness": 0}
    return ray.get(rt.scheduler.run.remote(1, scheduler=section, tag=tag), timeout=600)


@pytest.mark.parametrize("backend", BACKENDS)
def test_one_step_job_gives_the_same_update_through_every_backend(job, backend) -> None:
    rt, checkpoint = job
    transfer = {**rt.config.transfer.model_dump(), "weights": backend, "gradients": backend}
    for attempt in range(3):
        # Whoever is free claims the next micro-batch: when the satellite's weight pull through the
        # backend outlasts the core's few micro-steps, the core trains them all and no gradient
        # moves. Run the step again (from the same checkpoint, so the same tokens) until one did;
        # fresh transfer endpoints each time, as published versions only move forward.
        ray.get([cell.use_transfer.remote(transfer) for cell in rt.cells.values()], timeout=120)
        assert rt.restore(checkpoint) == 0  # every backend's job starts from the same weights and optimizer
        start = ray.get(rt.core.state_dict.remote(), timeout=60)
        result = _run(rt, f"{backend}-{attempt}.")  # one dot: the executor drops the tag
        (step,) = result["steps"]
        assert step["version"] == 1 and step["executions"] == step["valid"] == 2
        if "cell-1" in step["trained_by_cell"]:
            break
    assert set(step["trained_by_cell"]) == {"cell-0", "cell-1"}  # the satellite's gradients moved
    batches = ray.get(rt.scheduler.micro_batches.remote(0), timeout=60)
    final = ray.get(rt.core.state_dict.remote(), timeout=60)
    gap = relative_update_gap(start, final, reference_weights(rt, start, 0, batches))
    assert gap <= 1e-6, f"{backend}: the update differs from the single-trainer replay by {gap:.2e}"
    statuses = {c: _status(rt, c) for c in rt.pool.cell_ids}
    assert {s["engine"]["version"] for s in statuses.values()} == {1}  # every cell serves the update
    if backend == "collective":
        core, cell = statuses["cell-0"]["collective"], statuses["cell-1"]["collective"]
        assert core["last_push"]["received"] == ["cell-1"] and cell["fallback"] == 0
        assert core["collective"] >= 1 and cell["collective"] >= 1  # gradients pulled, weights broadcast
    print(f"{backend}: trained_by_cell {step['trained_by_cell']}, replay gap {gap:.2e}")
    JOBS[backend] = {"final": final, "tokens": _tokens(batches), "start": start}
    first_backend, first = next(iter(JOBS.items()))
    assert all(torch.equal(start[k], first["start"][k]) for k in start)
    assert JOBS[backend]["tokens"] == first["tokens"], f"{backend} and {first_backend} trained other batches"
    num = sum(float(((final[k] - first["final"][k]) ** 2).sum()) for k in final)
    den = sum(float(((first["final"][k] - start[k]) ** 2).sum()) for k in final)
    assert den > 0 and (num / den) ** 0.5 <= 1e-6, f"{backend} vs {first_backend}: {(num / den) ** 0.5:.2e}"
    print(f"{backend} vs {first_backend}: relative update gap {(num / den) ** 0.5:.2e}")
    if backend == "collective":
        check_restarted_cell_rejoins_through_the_fallback(rt)


def check_restarted_cell_rejoins_through_the_fallback(rt: Runtime) -> None:
    """cell-1 dies between steps; the next run's recovery restarts it (a new process, which missed v1's
    broadcast): it rejoins through the object store, and v2's group asks it again."""
    _kill_and_wait(ray.get_actor("cell-1", namespace=rt.namespace))
    result = _run(rt, "after-fault.")
    assert [f["cell"] for f in result["faults"]] == ["cell-1"] and result["faults"][0]["restarted"]
    assert result["steps"][0]["version"] == 2
    cell, core = _status(rt, "cell-1"), _status(rt, "cell-0")["collective"]
    assert cell["engine"]["version"] == 2 and not cell["draining"]
    assert cell["collective"]["fallback"] >= 1  # its rejoin: v1 was broadcast before it existed
    assert "not received by broadcast" in str(cell["collective"]["last_fallback"])
    assert core["last_push"]["version"] == 2 and "cell-1" in {
        *core["last_push"]["received"],
        *core["last_push"]["missed"],
    }
