"""Dual-role cells on Ray move weights and gradients through the transfer seam: the same update, bit for
bit, whichever backend carries them, and equal to the single-trainer reference."""

from __future__ import annotations

import os

import pytest
import ray
import torch
from test_elastic_invariance import ALGO, MODEL, TRAINER, make_batches, reference_update
from test_transfer import _kill_and_wait

from gyre_ray.algo.gspo import step_scale
from gyre_ray.cells.cell import TokenBatch
from gyre_ray.cells.dual_role import TrainerFactory
from gyre_ray.cells.factories import ScriptedEngineFactory
from gyre_ray.cells.pool import CellPool
from gyre_ray.engines.base import GenerateRequest
from gyre_ray.engines.testing import GREEDY
from gyre_ray.runtime.cluster import start_local_ray
from gyre_ray.transfer import Ticket, TransferError
from gyre_ray.transfer.mooncake import mooncake_available

MOONCAKE_OK, MOONCAKE_WHY = mooncake_available()
BACKENDS = [
    "object_store",
    pytest.param(
        "mooncake",
        marks=pytest.mark.skipif(
            not MOONCAKE_OK and os.environ.get("CI") != "true", reason=f"Mooncake cannot load: {MOONCAKE_WHY}"
        ),
    ),
]


@pytest.fixture(scope="module", autouse=True)
def ray_local():
    os.environ.setdefault("GLOG_minloglevel", "2")
    start_local_ray(num_cpus=2, include_dashboard=False, logging_level="WARNING")
    yield
    ray.shutdown()


def one_update(backend: str, batches: list) -> tuple[dict[str, torch.Tensor], dict[str, torch.Tensor]]:
    """Core and one satellite train half the micro-batches each; the satellite's gradients and the new
    weights go through `backend`. Returns (core's weights, the satellite's copy of them)."""
    transfer = {"weights": backend, "gradients": backend, "verify_checksums": True}
    pool = CellPool.start(
        2, ScriptedEngineFactory(), 0.5, prefix=f"t-{backend}", namespace=f"transfer-{backend}",
        trainer_factory=TrainerFactory(MODEL, TRAINER, ALGO, transfer),
    )  # fmt: skip
    try:
        core, sat = pool.actors.values()
        start = ray.get(core.publish_weights.remote())
        assert isinstance(start, Ticket) and start.backend == backend and start.version == 0
        ray.get([core.switch_to_training.remote(None, 0), sat.switch_to_training.remote(start, 0)])
        ray.get([(core if i % 2 == 0 else sat).train.remote(b) for i, b in enumerate(batches)])
        grads = ray.get(sat.export_grads.remote())
        assert isinstance(grads, Ticket) and grads.kind == "grads"
        assert ray.get(core.import_grads.remote(grads)) > 0
        ray.get(core.optimizer_step.remote(step_scale(batches)))
        published = ray.get(core.publish_weights.remote())
        assert published.version == 1
        ray.get(sat.load_trainer_weights.remote(published, 1))
        return ray.get(core.state_dict.remote()), ray.get(sat.state_dict.remote())
    finally:
        pool.shutdown()


@pytest.fixture(scope="module")
def batches() -> list:
    return make_batches()


@pytest.fixture(scope="module")
def reference(batches: list) -> dict[str, torch.Tensor]:
    return reference_update(batches)[0]


_UPDATES: dict[str, dict[str, torch.Tensor]] = {}  # backend -> the core's weights after its update


@pytest.mark.slow
@pytest.mark.parametrize("backend", BACKENDS)
def test_update_through_backend_equals_the_single_trainer_reference(
    backend: str, batches: list, reference: dict[str, torch.Tensor]
) -> None:
    core_weights, sat_weights = one_update(backend, batches)
    _UPDATES[backend] = core_weights
    for other, weights in _UPDATES.items():  # bytes move exactly: the same update, bit for bit
        assert all(torch.equal(weights[n], core_weights[n]) for n in reference), f"{backend} != {other}"
    for name, want in reference.items():
        assert torch.equal(core_weights[name], sat_weights[name]), f"{name}: the satellite's copy differs"
        err = float((core_weights[name] - want).norm() / want.norm().clamp(min=1e-30))
        assert err <= 1e-6, f"{backend}: {name} differs from the reference by {err:.2e}"


@pytest.mark.slow
@pytest.mark.skipif(
    not MOONCAKE_OK and os.environ.get("CI") != "true", reason=f"Mooncake cannot load: {MOONCAKE_WHY}"
)
def test_a_weight_transfer_whose_sender_dies_names_cell_and_version_and_the_cell_keeps_serving(
    batches: list,
) -> None:
    transfer = {"weights": "mooncake", "gradients": "mooncake"}
    pool = CellPool.start(
        2, ScriptedEngineFactory(), 0.5, prefix="t-fail", namespace="transfer-fail",
        trainer_factory=TrainerFactory(MODEL, TRAINER, ALGO, transfer),
    )  # fmt: skip
    try:
        core, cell = pool.actors.values()
        ray.get(core.switch_to_training.remote(None, 0))
        ray.get(core.train.remote(batches[0]))
        ray.get(core.optimizer_step.remote(1.0))
        ticket = ray.get(core.publish_weights.remote())
        assert ticket.version == 1 and ticket.backend == "mooncake"
        _kill_and_wait(core)  # the core is gone before cell-1 reads version 1
        with pytest.raises(ray.exceptions.RayTaskError) as info:
            ray.get(cell.update_weights.remote(ticket, 1))
        assert isinstance(info.value.cause, TransferError)
        message = str(info.value.cause)
        assert message.startswith("cell-1: receiving weights v1 from cell-0") and "peer gone" in message
        assert ray.get(cell.versions.remote())["engine"] == 0
        events = ray.get(cell.generate_all.remote(GenerateRequest("after", [5, 6, 7], GREEDY)))
        tokens = [e for batch in events if isinstance(batch, TokenBatch) for e in batch.events]
        assert len(tokens) == GREEDY.max_new_tokens and {e.version for e in tokens} == {0}
    finally:
        pool.shutdown()
