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


def test_a_rank_that_does_not_answer_ends_the_trainer_instead_of_skewing_later_replies() -> None:
    """After one rank's timeout the others' replies stay queued (or those ranks wait in a
    collective): the next call would read a stale reply. The trainer is closed instead, and says so."""
    import weakref
    from types import SimpleNamespace

    from gyre_ray.trainers.megatron.tensor_parallel import RankError

    closed: list[bool] = []
    sent: list[tuple] = []
    answering = SimpleNamespace(poll=lambda _t: True, recv=lambda: ("ok", 1), send=sent.append)
    silent = SimpleNamespace(poll=lambda _t: False, recv=lambda: ("ok", 1), send=sent.append)
    trainer = TensorParallelTrainer.__new__(TensorParallelTrainer)
    trainer._conns, trainer.timeout_s = [answering, silent], 0.01
    trainer._finalizer = weakref.finalize(trainer, closed.append, True)
    with pytest.raises(
        RankError, match="rank 1: no answer to step within 0 s; the trainer's rank processes are ended"
    ):
        trainer._call("step")
    assert closed == [True] and len(sent) == 2
    with pytest.raises(RankError, match="this tensor-parallel trainer is closed"):
        trainer._call("step")
    assert len(sent) == 2  # nothing sent to ranks that are gone


def test_a_rank_actor_that_does_not_answer_ends_the_ray_trainer(monkeypatch: pytest.MonkeyPatch) -> None:
    """The rank actors' version of the above: a timeout (or a failure other than bad input) kills
    the rank actors, the others of which may wait in a collective for the silent one."""
    import weakref

    import ray

    from gyre_ray.trainers.megatron.ray_ranks import RayTensorParallelTrainer
    from gyre_ray.trainers.megatron.tensor_parallel import RankError

    def get(ref: str, timeout: float) -> int:
        if ref == "silent":
            raise ray.exceptions.GetTimeoutError("no answer")
        if ref == "bad input":
            raise ValueError("token id 99 is outside the vocabulary")
        return 1

    monkeypatch.setattr(ray, "get", get)
    closed: list[bool] = []
    trainer = RayTensorParallelTrainer.__new__(RayTensorParallelTrainer)
    trainer.timeout_s = 0.01
    trainer._finalizer = weakref.finalize(trainer, closed.append, True)
    with pytest.raises(ValueError, match="outside the vocabulary"):
        trainer._gather(["ok", "bad input"], "forward_backward")
    assert closed == []  # bad input: the ranks keep serving
    with pytest.raises(
        RankError, match="actor 1: no answer to step within 0 s; the trainer's rank actors are ended"
    ):
        trainer._gather(["ok", "silent"], "step")
    assert closed == [True]
