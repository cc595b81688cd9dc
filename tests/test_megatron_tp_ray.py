"""Tensor parallel 2 as Ray actors (one per rank, gloo between them) equals tensor parallel 1: log-probs,
packed GSPO loss and gradients; the rank actors run inside the placement group they are given, and
inside a dual-role cell's own placement group when the cell builds a Megatron trainer."""

from __future__ import annotations

import dataclasses
import os
from collections.abc import Iterator

import pytest
import ray
from megatron_cases import gspo_loss, max_relative_error, model_args, packed_batches, require_megatron
from ray.util.placement_group import placement_group, remove_placement_group

from gyre_ray.cells.dual_role import TrainerFactory
from gyre_ray.cells.factories import ScriptedEngineFactory
from gyre_ray.cells.pool import CellPool
from gyre_ray.model.checkpoint import load_hf, read_hf_weights, save_hf
from gyre_ray.model.qwen3 import Qwen3ForCausalLM, init_weights
from gyre_ray.model.tokenizer import Tokenizer
from gyre_ray.runtime.cluster import start_local_ray
from gyre_ray.trainers.config import TrainerSection
from gyre_ray.trainers.factory import make_trainer
from gyre_ray.transfer import make_transport
from gyre_ray.transfer.config import TransferSection

require_megatron()

from gyre_ray.trainers.megatron.ray_ranks import RayTensorParallelTrainer  # noqa: E402

pytestmark = pytest.mark.slow
SECTION = dict(backend="megatron", lr=1e-2, weight_decay=0.01, grad_clip=1.0)


@pytest.fixture(scope="module")
def setup(tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple]:
    os.environ.setdefault("GLOG_minloglevel", "2")
    start_local_ray(num_cpus=2, include_dashboard=False, logging_level="WARNING")
    # the vocabulary fits the default tokenizer, which a cell loads with the policy
    args = dataclasses.replace(model_args(tied=True), vocab_size=Tokenizer.default().vocab_size)
    model = init_weights(Qwen3ForCausalLM(args), 0, std=0.2)
    folder = save_hf(model, args, tmp_path_factory.mktemp("tp-ray"))
    model, args = load_hf(folder)
    tp1 = make_trainer(TrainerSection(**SECTION), model, args, gspo_loss())
    yield folder, args, tp1, packed_batches(tp1)
    ray.shutdown()


def test_rank_actors_in_a_placement_group_equal_tensor_parallel_1(setup: tuple) -> None:
    folder, args, tp1, batches = setup
    group = placement_group([{"CPU": 1}])
    ray.get(group.ready(), timeout=60)
    section = TrainerSection(tensor_parallel_size=2, tensor_parallel_workers="ray", **SECTION)
    tp2 = RayTensorParallelTrainer(read_hf_weights(folder), args, section, gspo_loss(), placement_group=group)
    try:
        assert ray.get([actor.placement.remote() for actor in tp2.actors]) == [group.id.hex()] * 2
        for batch in batches:
            assert float((tp2.compute_logprobs(batch) - tp1.compute_logprobs(batch)).abs().max()) < 1e-5
        tp1.zero_grads()
        a, b = tp1.forward_backward(batches[0]), tp2.forward_backward(batches[0])
        assert abs(a["loss"] - b["loss"]) <= 1e-5 * max(1.0, abs(a["loss"]))
        assert max_relative_error(tp1.export_grads(), tp2.export_grads()) < 1e-5
        bad = packed_batches(tp1)[0]
        bad.input_ids[0, 0] = 10_000
        with pytest.raises(ValueError, match="outside the vocabulary"):
            tp2.compute_logprobs(bad)
        assert tp2.metadata()["tensor_parallel_size"] == 2  # the ranks keep serving
    finally:
        tp1.zero_grads()
        tp2.close()
        remove_placement_group(group)


def test_a_dual_role_cell_runs_its_megatron_ranks_as_actors_in_its_placement_group(setup: tuple) -> None:
    folder, _, tp1, batches = setup
    trainer = {**SECTION, "tensor_parallel_size": 2}
    factory = TrainerFactory({"path": str(folder)}, trainer, {}, {})
    pool = CellPool.start(
        1, ScriptedEngineFactory(), 1.0, prefix="tpr", namespace="tp-ray", trainer_factory=factory
    )
    try:
        cell = pool.actors["cell-0"]
        ranks = [ray.get_actor(f"tpr-0-tp{rank}") for rank in range(2)]  # the job's namespace
        assert ray.get([r.placement.remote() for r in ranks]) == [pool.groups["cell-0"].id.hex()] * 2
        ray.get(cell.switch_to_training.remote(None, 0))
        got = ray.get(cell.train.remote(batches[0]))
        ticket = ray.get(cell.export_grads.remote())  # through the cell's transfer seam
        grads = make_transport("object_store", TransferSection(), owner="test").fetch(ticket)
        tp1.zero_grads()
        want = tp1.forward_backward(batches[0])
        assert abs(got["loss"] - want["loss"]) <= 1e-5 * max(1.0, abs(want["loss"]))
        assert max_relative_error(tp1.export_grads(), grads) < 1e-5
    finally:
        tp1.zero_grads()
        pool.shutdown()
