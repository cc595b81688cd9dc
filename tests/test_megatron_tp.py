"""Tensor parallel 2 (two rank processes over gloo on 127.0.0.1) equals tensor parallel 1: log-probs,
packed GSPO gradients under HF names, the clipped AdamW update, and the weights it publishes."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest
import torch
from megatron_cases import assert_trains_alike, gspo_loss, hf_folder, packed_batches, require_megatron

from gyre_ray.model.checkpoint import load_hf, read_hf_weights
from gyre_ray.trainers.config import TrainerSection
from gyre_ray.trainers.factory import make_trainer

require_megatron()

from gyre_ray.trainers.megatron.tensor_parallel import TensorParallelTrainer  # noqa: E402

pytestmark = pytest.mark.slow
SECTION = dict(backend="megatron", lr=1e-2, weight_decay=0.01, grad_clip=1.0)


# Tied (the toy default): the vocab-parallel embedding is also the output layer. The untied layout's
# TP figures are in benchmarks/results/megatron_parity_cpu2.json; its shards are tested in
# test_megatron_convert.py.
@pytest.fixture(scope="module", params=[True], ids=["tied"])
def pair(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple]:
    folder = hf_folder(tmp_path_factory.mktemp("tp"), tied=request.param)
    model, args = load_hf(folder)
    tp1 = make_trainer(TrainerSection(**SECTION), model, args, gspo_loss())
    tp2 = make_trainer(TrainerSection(tensor_parallel_size=2, **SECTION), model, args, gspo_loss())
    assert isinstance(tp2, TensorParallelTrainer)
    yield tp1, tp2, folder
    tp2.close()


def test_tensor_parallel_2_equals_tensor_parallel_1(pair: tuple, tmp_path: Path) -> None:
    tp1, tp2, folder = pair
    before = assert_trains_alike(tp1, tp2, packed_batches(tp1))
    assert tp2.version == 1
    after2 = tp2.state_dict()
    saved = read_hf_weights(tp2.save(tmp_path / "ckpt"))  # rank 0 writes the gathered HF folder
    assert saved.keys() == after2.keys() and all(torch.equal(saved[k], after2[k]) for k in saved)
    tp2.load_state_dict(read_hf_weights(folder), version=7)  # weights in: sharded again on every rank
    assert tp2.version == 7 and all(torch.equal(tp2.state_dict()[k], v) for k, v in before.items())


def test_a_bad_batch_raises_in_the_caller_and_ranks_keep_serving(pair: tuple) -> None:
    tp1, tp2, _ = pair
    batch = packed_batches(tp1)[0]
    batch.input_ids[0, 0] = 10_000
    with pytest.raises(ValueError, match="outside the vocabulary"):
        tp2.compute_logprobs(batch)
    assert tp2.metadata()["tensor_parallel_size"] == 2
    assert tp2.export_grads().keys() == tp1.export_grads().keys()
