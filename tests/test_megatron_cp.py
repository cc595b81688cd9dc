"""Context parallelism (trainer.context_parallel_size): a micro-batch's columns split among rank
processes (gloo on 127.0.0.1), balanced alone and under tensor parallel 2, and contiguous, equals one rank: log-probs of tree
and causal rows (a width that does not split evenly included), packed GSPO gradients under HF names,
the clipped AdamW update, and a checkpoint written once."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest
import torch
from megatron_cases import (
    assert_trains_alike,
    gspo_loss,
    hf_folder,
    is_tree,
    max_relative_error,
    packed_batches,
    require_megatron,
)

from gyre_ray.model.checkpoint import load_hf, read_hf_weights
from gyre_ray.trainers.batch import MicroBatch, sequential_parent_index
from gyre_ray.trainers.config import TrainerSection
from gyre_ray.trainers.factory import make_trainer

require_megatron()

from gyre_ray.trainers.megatron.tensor_parallel import TensorParallelTrainer  # noqa: E402

pytestmark = pytest.mark.slow
SECTION = dict(backend="megatron", lr=1e-2, weight_decay=0.01, grad_clip=1.0)


@pytest.fixture(
    scope="module",
    params=[(1, 2, "balanced"), (2, 2, "balanced"), (1, 2, "contiguous")],
    ids=["cp2", "tp2-cp2", "cp2-contiguous"],
)
def pair(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple]:
    tp, cp, split = request.param
    folder = hf_folder(tmp_path_factory.mktemp("cp"), tied=True)
    model, args = load_hf(folder)
    one = make_trainer(TrainerSection(**SECTION), model, args, gspo_loss())
    section = TrainerSection(
        tensor_parallel_size=tp, context_parallel_size=cp, context_parallel_split=split, **SECTION
    )
    split = make_trainer(section, model, args, gspo_loss())
    assert isinstance(split, TensorParallelTrainer) and len(split._processes) == tp * cp
    yield one, split, folder
    split.close()


def causal_batch(rows: int = 2, length: int = 19) -> MicroBatch:
    """Plain rows of an odd width: the last rank's share is padded."""
    ids = torch.randint(1, 256, (rows, length), generator=torch.Generator().manual_seed(5))
    position_ids = torch.arange(length).expand(rows, length).clone()
    return MicroBatch(ids, position_ids, sequential_parent_index(rows, length))


def test_context_parallel_equals_one_rank(pair: tuple, tmp_path: Path) -> None:
    one, split, folder = pair
    batches = packed_batches(one)
    assert any(is_tree(b) and b.input_ids.size(1) % 2 for b in batches)  # a padded share among them
    causal = causal_batch()
    assert float((split.compute_logprobs(causal) - one.compute_logprobs(causal)).abs().max()) < 1e-5
    before = assert_trains_alike(one, split, batches)
    after2 = split.state_dict()
    saved = split.save(tmp_path / "ckpt")  # one copy: the context-parallel ranks hold the same state
    weights = read_hf_weights(saved)
    assert weights.keys() == after2.keys() and all(torch.equal(weights[k], after2[k]) for k in weights)
    tp = split.metadata()["tensor_parallel_size"]
    assert sorted(p.name for p in saved.glob("trainer_state*.pt")) == [
        f"trainer_state_tp{r}.pt" for r in range(tp)
    ]
    split.load(saved)  # every rank reads the one trainer_state its tensor-parallel rank wrote
    assert (split.step, split.version) == (1, 1)
    split.load_state_dict(read_hf_weights(folder), version=7)
    assert split.version == 7 and all(torch.equal(split.state_dict()[k], v) for k, v in before.items())


def test_a_rank_holding_no_loss_tokens_predictor_still_trains_alike(pair: tuple) -> None:
    """Loss tokens all predicted from rank 0's columns: rank 1 scores nothing, yet its backward must run
    the decoder's (whose column gathers rank 0 joins) and the gradients equal one rank's. Under tensor
    parallel its log-probs were not tied to its hidden states then: its backward failed and rank 0's
    waited on it."""
    from gyre_ray.trainers.megatron.context_parallel import local_parents, share_of

    one, split, folder = pair
    weights = read_hf_weights(folder)
    one.load_state_dict(weights, version=9)
    split.load_state_dict(weights, version=9)
    batch = next(b for b in packed_batches(one) if is_tree(b))
    section = split.section
    share = share_of(batch, section.context_parallel_size, 1, section.context_parallel_split)
    held_by_1 = (local_parents(share) >= 0)[:, : share.length]
    loss = batch.tensors["loss_mask"]
    kept = loss & ~held_by_1
    assert 0 < int(kept.sum()) < int(loss.sum())  # some loss tokens left, none predicted on rank 1
    batch.tensors["loss_mask"] = kept
    a, b = one.forward_backward(batch), split.forward_backward(batch)
    assert abs(a["loss"] - b["loss"]) <= 1e-5 * max(1.0, abs(a["loss"]))
    grads1, grads2 = one.export_grads(), split.export_grads()
    assert (
        max_relative_error(grads1, grads2) < 1e-5
        and max(float(g.abs().max()) for g in grads1.values()) > 1e-3
    )
    one.zero_grads()
    split.zero_grads()


def test_a_dense_mask_cannot_be_split(pair: tuple) -> None:
    _, split, _ = pair
    batch = causal_batch()
    dense = torch.ones(19, 19, dtype=torch.bool).tril().expand(2, 19, 19).clone()
    bad = MicroBatch(batch.input_ids, batch.position_ids, batch.parent_index, dense)
    with pytest.raises(ValueError, match="context parallelism needs the micro-batch's tree layout"):
        split.compute_logprobs(bad)
    assert split.compute_logprobs(batch).shape == (2, 19)  # the ranks keep serving
