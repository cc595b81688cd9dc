"""The torch trainer: summed gradients, gradient exchange between replicas, scaled AdamW steps,
checkpoints that resume exactly, packed rows, and the engine/trainer log-probability agreement."""

from __future__ import annotations

import asyncio
import random

import numpy as np
import pytest
import torch

from gyre_ray.engines.base import GenerateRequest, SamplingParams
from gyre_ray.engines.torch_engine import TorchEngine
from gyre_ray.model.arch import ModelArgs
from gyre_ray.model.qwen3 import Qwen3ForCausalLM, init_weights
from gyre_ray.trainers.batch import MicroBatch, sequential_parent_index
from gyre_ray.trainers.config import TrainerSection
from gyre_ray.trainers.factory import make_trainer
from gyre_ray.trainers.torch_trainer import TorchTrainer, TrainerInputError

ARGS = ModelArgs(
    vocab_size=256,
    hidden_size=48,
    intermediate_size=96,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    head_dim=12,
    max_position_embeddings=512,
    eos_token_id=0,
)
SECTION = TrainerSection(lr=1e-2, grad_clip=1.0, weight_decay=0.01)


def sum_loss(logprobs: torch.Tensor, batch: MicroBatch):
    """A per-token weighted sum: additive over rows, so batches can be split or merged freely."""
    weights = batch.tensors["weights"]
    loss = -(logprobs * weights).sum()
    return loss, {"tokens": float((weights != 0).sum())}


def make_model(seed: int = 0) -> Qwen3ForCausalLM:
    return init_weights(Qwen3ForCausalLM(ARGS), seed, std=0.2)


def trainer(seed: int = 0, section: TrainerSection = SECTION) -> TorchTrainer:
    return TorchTrainer(make_model(seed), ARGS, section, sum_loss)


def batch(rows: int, length: int, seed: int) -> MicroBatch:
    gen = torch.Generator().manual_seed(seed)
    ids = torch.randint(1, ARGS.vocab_size, (rows, length), generator=gen)
    return MicroBatch(
        input_ids=ids,
        position_ids=torch.arange(length).expand(rows, length).clone(),
        parent_index=sequential_parent_index(rows, length),
        tensors={"weights": torch.rand((rows, length), generator=gen) - 0.3},
    )


def concat(a: MicroBatch, b: MicroBatch) -> MicroBatch:
    return MicroBatch(
        input_ids=torch.cat([a.input_ids, b.input_ids]),
        position_ids=torch.cat([a.position_ids, b.position_ids]),
        parent_index=torch.cat([a.parent_index, b.parent_index]),
        tensors={"weights": torch.cat([a.tensors["weights"], b.tensors["weights"]])},
    )


def assert_grads_close(a: dict, b: dict, tol: float = 1e-5) -> None:
    assert a.keys() == b.keys()
    for name in a:
        torch.testing.assert_close(a[name], b[name], atol=tol, rtol=tol, msg=name)


def test_two_forward_backward_calls_sum_like_one_call_on_both_batches() -> None:
    b1, b2 = batch(2, 20, seed=1), batch(3, 20, seed=2)
    split, joined = trainer(), trainer()
    m1, m2 = split.forward_backward(b1), split.forward_backward(b2)
    mj = joined.forward_backward(concat(b1, b2))
    assert mj["loss"] == pytest.approx(m1["loss"] + m2["loss"], rel=1e-5)
    assert mj["tokens"] == m1["tokens"] + m2["tokens"]
    assert_grads_close(split.export_grads(), joined.export_grads())
    norm = torch.sqrt(sum((g**2).sum() for g in joined.export_grads().values()))
    assert norm > 0


def test_gradients_exchanged_between_replicas_equal_one_replica_doing_all() -> None:
    b1, b2 = batch(2, 16, seed=3), batch(2, 16, seed=4)
    core, satellite, single = trainer(), trainer(), trainer()
    core.forward_backward(b1)
    satellite.forward_backward(b2)
    core.import_grads(satellite.export_grads())
    single.forward_backward(b1)
    single.forward_backward(b2)
    assert_grads_close(core.export_grads(), single.export_grads())
    core.optimizer_step(scale=0.5)
    single.optimizer_step(scale=0.5)
    for (name, a), b in zip(core.state_dict().items(), single.state_dict().values(), strict=True):
        torch.testing.assert_close(a, b, atol=1e-6, rtol=1e-5, msg=name)
    with pytest.raises(TrainerInputError, match="no parameter named"):
        core.import_grads({"not.a.param": torch.zeros(1)})


def test_optimizer_step_scales_once_clips_and_bumps_step_and_version() -> None:
    b = batch(2, 12, seed=5)
    twice, once = (
        trainer(section=SECTION.model_copy(update={"grad_clip": 0.0})),
        trainer(section=SECTION.model_copy(update={"grad_clip": 0.0})),
    )
    twice.forward_backward(b)
    twice.forward_backward(b)
    once.forward_backward(b)
    norm_once = torch.sqrt(sum((g.double() ** 2).sum() for g in once.export_grads().values()))
    m_twice, m_once = twice.optimizer_step(scale=0.5), once.optimizer_step(scale=1.0)
    assert m_twice["grad_norm"] == pytest.approx(m_once["grad_norm"], rel=1e-5)
    assert m_once["grad_norm"] == pytest.approx(float(norm_once), rel=1e-5)
    for a, c in zip(twice.state_dict().values(), once.state_dict().values(), strict=True):
        torch.testing.assert_close(a, c, atol=1e-6, rtol=1e-5)
    assert (once.step, once.version) == (1, 1)
    assert all(float(g.abs().sum()) == 0 for g in once.export_grads().values())  # zeroed after the step

    clipped = trainer(section=SECTION.model_copy(update={"grad_clip": 1e-3}))
    clipped.forward_backward(b)
    before = clipped.state_dict()
    clipped.optimizer.param_groups[0]["lr"] = 0.0  # isolate the clip: inspect grads before the step
    grads = [p.grad.clone() for p in clipped.params.values()]
    clipped.optimizer_step(scale=1.0)
    assert float(torch.sqrt(sum((g**2).sum() for g in grads))) > 1e-3
    assert all(torch.equal(before[k], v) for k, v in clipped.state_dict().items())


def test_non_finite_gradients_skip_the_step() -> None:
    t = trainer()
    t.forward_backward(batch(1, 8, seed=6))
    next(iter(t.params.values())).grad[0, 0] = float("nan")
    before = t.state_dict()
    metrics = t.optimizer_step(scale=1.0)
    assert metrics["skipped"] == 1.0 and t.step == 0 and t.version == 0
    assert all(torch.equal(before[k], v) for k, v in t.state_dict().items())


def test_save_and_load_reproduce_the_next_step_exactly(tmp_path) -> None:
    b1, b2 = batch(2, 16, seed=7), batch(2, 16, seed=8)
    original = trainer(seed=0)
    original.forward_backward(b1)
    original.optimizer_step(scale=1.0)
    original.save(tmp_path / "ckpt")

    restored = trainer(seed=42)  # different initial weights and no optimizer state
    restored.load(tmp_path / "ckpt")
    assert (restored.step, restored.version) == (1, 1)
    for m in (original, restored):
        m.forward_backward(b2)
        m.optimizer_step(scale=1.0)
    for (name, a), b in zip(original.state_dict().items(), restored.state_dict().values(), strict=True):
        assert torch.equal(a, b), name
    assert (tmp_path / "ckpt" / "config.json").is_file()
    assert (tmp_path / "ckpt" / "model.safetensors").is_file()


def test_load_restores_rng_states(tmp_path) -> None:
    t = trainer()
    t.save(tmp_path / "c")
    expected = (torch.rand(4), random.random(), float(np.random.rand()))
    t.load(tmp_path / "c")
    got = (torch.rand(4), random.random(), float(np.random.rand()))
    assert torch.equal(expected[0], got[0]) and expected[1:] == got[1:]


def test_packed_rows_with_a_block_mask_give_each_sequences_own_logprobs() -> None:
    t = trainer()
    a, b = batch(1, 9, seed=9), batch(1, 6, seed=10)
    ids = torch.cat([a.input_ids, b.input_ids], 1)
    mask = torch.zeros((1, 15, 15), dtype=torch.bool)
    mask[0, :9, :9] = torch.tril(torch.ones(9, 9, dtype=torch.bool))
    mask[0, 9:, 9:] = torch.tril(torch.ones(6, 6, dtype=torch.bool))
    parents = torch.cat([torch.arange(9) - 1, torch.arange(6) - 1 + 9]).unsqueeze(0)
    parents[0, 9] = -1  # the second sequence's first token has no predecessor
    packed = MicroBatch(ids, torch.cat([torch.arange(9), torch.arange(6)]).unsqueeze(0), parents, mask)
    got = t.compute_logprobs(packed)[0]
    torch.testing.assert_close(got[:9], t.compute_logprobs(a)[0], atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(got[9:], t.compute_logprobs(b)[0], atol=1e-5, rtol=1e-5)


def test_bad_micro_batches_are_refused_naming_the_field() -> None:
    t = trainer()
    good = batch(1, 6, seed=11)
    with pytest.raises(TrainerInputError, match="outside the vocabulary"):
        t.forward_backward(MicroBatch(good.input_ids + 1000, good.position_ids, good.parent_index))
    with pytest.raises(TrainerInputError, match="parent_index"):
        t.forward_backward(MicroBatch(good.input_ids, good.position_ids, good.parent_index + 1))
    with pytest.raises(TrainerInputError, match="position_ids shape"):
        t.forward_backward(MicroBatch(good.input_ids, good.position_ids[:, :3], good.parent_index))
    with pytest.raises(TrainerInputError, match="attention_mask must be bool"):  # (B, T, T), not (B, T)
        mask = torch.ones_like(good.input_ids, dtype=torch.bool)
        t.forward_backward(MicroBatch(good.input_ids, good.position_ids, good.parent_index, mask))


def test_engine_logprobs_equal_the_trainers_recomputed_logprobs() -> None:
    model = make_model()
    engine = TorchEngine(model, ARGS, stop_token_ids=[], prefix_cache_tokens=0)
    prompt = [(11 * i) % 250 + 1 for i in range(23)]

    async def both():
        sampled = engine.generate(
            GenerateRequest("s", prompt, SamplingParams(temperature=1.0, max_new_tokens=40, seed=3))
        )
        greedy = engine.generate(
            GenerateRequest("g", prompt[:13], SamplingParams(temperature=0.0, max_new_tokens=40))
        )
        return await asyncio.gather(sampled, greedy)

    results = asyncio.run(both())
    engine.shutdown()
    t = TorchTrainer(model, ARGS, SECTION, sum_loss)
    for result in results:
        ids = torch.tensor([result.input_ids + result.output_ids])
        n = ids.size(1)
        mb = MicroBatch(ids, torch.arange(n).unsqueeze(0), sequential_parent_index(1, n))
        recomputed = t.compute_logprobs(mb)[0, len(result.input_ids) :]
        engine_lp = torch.tensor(result.output_logprobs)
        assert float((recomputed - engine_lp).abs().max()) < 1e-5
        assert float(engine_lp.min()) < -0.5  # sampled / real tokens, not all near-certain


def test_factory_builds_torch() -> None:  # the megatron backend: tests/test_megatron_trainer.py
    t = make_trainer(SECTION, make_model(), ARGS, sum_loss, version=4)
    assert isinstance(t, TorchTrainer) and t.version == 4


def test_forward_backward_scores_the_loss_tokens_alone_with_the_same_gradients() -> None:
    seen: list[torch.Tensor] = []

    def masked_loss(logprobs: torch.Tensor, b: MicroBatch):
        seen.append(logprobs.detach().clone())
        return sum_loss(logprobs * b.tensors["loss_mask"], b)

    data = batch(3, 40, seed=4)
    mask = torch.rand(data.input_ids.shape, generator=torch.Generator().manual_seed(5)) < 0.2
    data.tensors["loss_mask"] = mask
    masked = TorchTrainer(make_model(), ARGS, SECTION, masked_loss)
    masked.forward_backward(data)
    everything = masked.compute_logprobs(data)  # every token, as the `logprobs` CLI scores them
    scored = seen[0]
    assert torch.equal(scored[~mask], torch.zeros_like(scored[~mask]))
    assert torch.allclose(scored[mask], everything[mask], atol=1e-6)
    assert (everything[~mask & (data.parent_index >= 0)] != 0).all()
    unmasked = data.tensors.pop("loss_mask")  # no mask: every token scored, the loss masks them
    full = TorchTrainer(make_model(), ARGS, SECTION, lambda lp, b: sum_loss(lp * unmasked, b))
    full.forward_backward(data)
    for name, p in masked.params.items():
        assert torch.allclose(p.grad, full.params[name].grad, rtol=1e-5, atol=1e-7), name


def bf16_trainer(section: TrainerSection) -> TorchTrainer:
    return TorchTrainer(
        init_weights(Qwen3ForCausalLM(ARGS, dtype=torch.bfloat16), 0, std=0.2), ARGS, section, sum_loss
    )


def test_a_bfloat16_model_is_stepped_through_float32_master_weights() -> None:
    """AdamW stepping bfloat16 weights in place rounded most updates away (an lr-1e-5 step is below
    half a rounding step of any weight above ~2e-3): 85% of the tiny model's weights never moved."""
    section = TrainerSection(lr=1e-5, grad_clip=0.0)
    t = bf16_trainer(section)
    assert t.master is not None and all(m.dtype == torch.float32 for m in t.master.tensors())
    start = {k: v.detach().float().clone() for k, v in t.params.items()}
    b = batch(2, 16, seed=7)
    for _ in range(3):
        t.forward_backward(b)
        t.optimizer_step(1.0)
    moved = total = 0
    for name, param in t.params.items():
        master = t.master.master[name]
        assert torch.equal(param, master.to(torch.bfloat16)), name  # the model holds the rounded master
        delta = (master - start[name]).abs()
        moved += int((delta > 2e-5).sum())  # 3 Adam steps of ~lr each, one direction mostly
        total += delta.numel()
        assert float(delta.max()) <= 3 * 1e-5 * 1.01, name  # Adam's step is at most ~lr
    assert moved / total > 0.6, f"only {moved}/{total} master weights moved"  # in place: 15%
    assert all(s["exp_avg"].dtype == torch.float32 for s in t.optimizer.state.values())
    float32 = trainer(section=section)
    assert float32.master is None


def test_a_bfloat16_checkpoint_keeps_the_master_weights(tmp_path) -> None:
    section = TrainerSection(lr=1e-5, grad_clip=0.0)
    original = bf16_trainer(section)
    b = batch(2, 16, seed=7)
    original.forward_backward(b)
    original.optimizer_step(1.0)
    original.save(tmp_path / "ckpt")
    restored = bf16_trainer(section)
    restored.load(tmp_path / "ckpt")
    for name, tensor in original.master.master.items():  # not the rounded bfloat16 weights
        assert torch.equal(restored.master.master[name], tensor), name
    for t in (original, restored):
        t.forward_backward(b)
        t.optimizer_step(1.0)
    for name, tensor in original.master.master.items():
        assert torch.equal(restored.master.master[name], tensor), name


def test_a_resume_takes_the_sections_optimizer_settings_not_the_checkpoints(tmp_path) -> None:
    """Loading the optimizer state brought back the saved run's lr, betas, eps and weight decay: a
    resume with trainer.lr changed trained (and reported) the old lr."""
    original = trainer(section=TrainerSection(lr=1e-5))
    original.forward_backward(batch(2, 16, seed=7))
    original.optimizer_step(1.0)
    original.save(tmp_path / "ckpt")
    changed = TrainerSection(lr=1e-3, weight_decay=0.1, betas=(0.8, 0.99), eps=1e-6)
    resumed = trainer(seed=3, section=changed)
    resumed.load(tmp_path / "ckpt")
    group = resumed.optimizer.param_groups[0]
    assert (group["lr"], group["weight_decay"], tuple(group["betas"]), group["eps"]) == (
        1e-3,
        0.1,
        (0.8, 0.99),
        1e-6,
    )
    assert resumed.optimizer.state  # the moments are the checkpoint's
    resumed.forward_backward(batch(2, 16, seed=8))
    assert resumed.optimizer_step(1.0)["lr"] == 1e-3
