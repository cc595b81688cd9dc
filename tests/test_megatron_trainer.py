"""The Megatron-core trainer (tensor parallel 1, in this process) against the torch trainer and
transformers on the same HF folders: log-probs on plain and tree-packed rows, gradients of packed GSPO
micro-batches, the first AdamW update, gradient exchange across backends, bit-exact weights in and
out, checkpoints, and clear errors."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from megatron_cases import (
    gspo_loss,
    hf_folder,
    is_tree,
    max_relative_error,
    packed_batches,
    require_megatron,
    update_relative_error,
)

from gyre_ray.algo.gspo import step_scale
from gyre_ray.model.checkpoint import load_hf, read_hf_weights
from gyre_ray.trainers.batch import MicroBatch, sequential_parent_index, token_logprobs
from gyre_ray.trainers.config import TrainerSection
from gyre_ray.trainers.factory import make_trainer

require_megatron()

from gyre_ray.trainers.megatron.trainer import MegatronInputError, MegatronTrainer  # noqa: E402

# lr 1e-2: an update is read as (after - before) in float32, whose resolution is one ulp of a weight
# (~3e-8 at 0.4); a 1e-5 relative comparison of the update needs steps well above 3e-3.
SECTION = dict(lr=1e-2, weight_decay=0.01, grad_clip=1.0)


def trainers(folder: Path) -> tuple:
    """(torch trainer, Megatron trainer) over the same HF folder, built by the backend factory."""
    loss = gspo_loss()
    model, args = load_hf(folder)
    torch_trainer = make_trainer(TrainerSection(**SECTION), model, args, loss)
    megatron = make_trainer(TrainerSection(backend="megatron", **SECTION), load_hf(folder)[0], args, loss)
    assert isinstance(megatron, MegatronTrainer)
    return torch_trainer, megatron


def plain_batch(rows: int = 2, length: int = 19, seed: int = 3) -> MicroBatch:
    ids = torch.randint(1, 256, (rows, length), generator=torch.Generator().manual_seed(seed))
    return MicroBatch(
        input_ids=ids,
        position_ids=torch.arange(length).expand(rows, length).clone(),
        parent_index=sequential_parent_index(rows, length),
    )


@pytest.mark.parametrize("tied", [False, True])
def test_logprobs_equal_torch_trainer_and_transformers(tmp_path: Path, tied: bool) -> None:
    from transformers import Qwen3ForCausalLM as HFQwen3

    folder = hf_folder(tmp_path, tied)
    torch_trainer, megatron = trainers(folder)
    plain = plain_batch()
    hf_model = HFQwen3.from_pretrained(folder, dtype=torch.float32).eval()
    with torch.no_grad():
        hf_logits = hf_model(input_ids=plain.input_ids).logits
    reference = token_logprobs(hf_logits, plain.input_ids, plain.parent_index)
    assert float((megatron.compute_logprobs(plain) - reference).abs().max()) < 1e-5
    assert float(reference[:, 1:].min()) < -3.0  # real log-probs, far from uniform (log 256 = -5.5)
    trees = packed_batches(torch_trainer)
    assert any(is_tree(b) for b in trees) and any(b.attention_mask is not None for b in trees)
    for batch in trees:
        gap = (megatron.compute_logprobs(batch) - torch_trainer.compute_logprobs(batch)).abs().max()
        assert float(gap) < 1e-5


@pytest.mark.parametrize("tied", [False, True])
def test_packed_gspo_gradients_and_first_update_equal_torch(tmp_path: Path, tied: bool) -> None:
    torch_trainer, megatron = trainers(hf_folder(tmp_path, tied))
    batches = packed_batches(torch_trainer)
    before = torch_trainer.state_dict()
    for batch in batches:
        a, b = torch_trainer.forward_backward(batch), megatron.forward_backward(batch)
        assert abs(a["loss"] - b["loss"]) <= 1e-5 * max(1.0, abs(a["loss"]))
    grads_torch, grads_megatron = torch_trainer.export_grads(), megatron.export_grads()
    assert max_relative_error(grads_torch, grads_megatron) < 1e-5
    assert max(float(g.abs().max()) for g in grads_torch.values()) > 1e-3  # there is a gradient to compare
    scale = step_scale(batches)
    m_torch, m_megatron = torch_trainer.optimizer_step(scale), megatron.optimizer_step(scale)
    assert m_torch["grad_norm"] == pytest.approx(m_megatron["grad_norm"], rel=1e-5)
    assert megatron.version == torch_trainer.version == 1
    after_torch, after_megatron = torch_trainer.state_dict(), megatron.state_dict()
    after_torch = {k: v for k, v in after_torch.items() if k in after_megatron}
    start = {k: before[k] for k in after_torch}
    error, covered = update_relative_error(start, after_torch, after_megatron, grads_torch, min_grad=1e-3)
    assert error < 1e-5 and covered > 0.99, (error, covered)


def test_training_runs_the_lm_head_on_the_loss_tokens_alone(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """`forward_backward` scores only the loss tokens (the model's own outputs), as the torch trainer
    does: the LM head sees their predicting columns alone; their log-probs equal the full scoring's,
    and every other token reads 0 (the loss reads none of them)."""
    from gyre_ray.trainers import batch as batch_module

    torch_trainer, megatron = trainers(hf_folder(tmp_path, tied=True))
    batch = packed_batches(torch_trainer)[0]
    has_parent = batch.parent_index >= 0
    loss_tokens = batch.tensors["loss_mask"].bool() & has_parent
    assert 0 < int(loss_tokens.sum()) < int(has_parent.sum())  # prompts and tool output are not scored
    rows_scored: list[int] = []
    real = batch_module._ChunkedTargetLogprob.apply
    monkeypatch.setattr(
        batch_module._ChunkedTargetLogprob,
        "apply",
        lambda h, *rest: rows_scored.append(h.shape[0]) or real(h, *rest),
    )
    full = megatron.compute_logprobs(batch)
    loss_only = megatron._logprobs(batch, loss_only=True).detach()
    assert rows_scored == [int(has_parent.sum()), int(loss_tokens.sum())]
    assert float(loss_only[loss_tokens].sub(full[loss_tokens]).abs().max()) < 1e-6
    assert not loss_only[~loss_tokens].any() and bool(full[loss_tokens].lt(-1e-3).all())


def test_hf_weights_in_and_out_are_bit_exact(tmp_path: Path) -> None:
    folder = hf_folder(tmp_path, tied=False)
    weights = read_hf_weights(folder)
    _, megatron = trainers(folder)
    out = megatron.state_dict()
    assert out.keys() == weights.keys() and all(torch.equal(out[k], weights[k]) for k in weights)
    names = set(megatron.megatron_state_dict())
    assert "decoder.layers.0.self_attention.linear_qkv.weight" in names and "output_layer.weight" in names
    saved = megatron.save(tmp_path / "ckpt")
    again = read_hf_weights(saved)
    assert all(torch.equal(again[k], weights[k]) for k in weights)


def test_gradients_move_between_megatron_and_torch_replicas(tmp_path: Path) -> None:
    """A Megatron satellite's gradients import into a torch core (and back) under the same names."""
    torch_trainer, megatron = trainers(hf_folder(tmp_path, tied=True))
    batches = packed_batches(torch_trainer)
    megatron.forward_backward(batches[0])
    torch_trainer.import_grads(megatron.export_grads())
    megatron.zero_grads()
    megatron.import_grads(torch_trainer.export_grads())
    megatron.import_grads(torch_trainer.export_grads())
    doubled = megatron.export_grads()
    single = torch_trainer.export_grads()
    assert max_relative_error({k: 2 * v for k, v in single.items()}, doubled) < 1e-6


def test_checkpoint_resumes_the_same_next_update(tmp_path: Path) -> None:
    folder = hf_folder(tmp_path, tied=False)
    torch_trainer, megatron = trainers(folder)
    batches = packed_batches(torch_trainer)
    megatron.forward_backward(batches[0])
    megatron.optimizer_step(1.0)
    megatron.save(tmp_path / "ckpt")
    megatron.forward_backward(batches[0])
    megatron.optimizer_step(1.0)
    resumed = MegatronTrainer(read_hf_weights(folder), megatron.args, megatron.section, gspo_loss())
    resumed.load(tmp_path / "ckpt")
    assert (resumed.step, resumed.version) == (1, 1)
    resumed.forward_backward(batches[0])
    resumed.optimizer_step(1.0)
    a, b = megatron.state_dict(), resumed.state_dict()
    assert all(torch.equal(a[k], b[k]) for k in a)


def test_bad_input_is_named(tmp_path: Path) -> None:
    _, megatron = trainers(hf_folder(tmp_path, tied=False))
    bad = plain_batch()
    bad.parent_index[0, 3] = 5
    with pytest.raises(MegatronInputError, match="parent_index"):
        megatron.compute_logprobs(bad)
    with pytest.raises(MegatronInputError, match="no parameter named"):
        megatron.import_grads({"model.nope.weight": torch.zeros(1)})
    grads = megatron.export_grads()
    grads["model.norm.weight"] = torch.zeros(3)
    with pytest.raises(MegatronInputError, match="shapes differ"):
        megatron.import_grads(grads)
    with pytest.raises(MegatronInputError, match="finite"):
        megatron.optimizer_step(float("nan"))
    with pytest.raises(ValueError, match="does not divide ModelArgs.num_key_value_heads"):
        make_trainer(
            TrainerSection(backend="megatron", tensor_parallel_size=4),
            *load_hf(tmp_path / "hf-untied"),
            gspo_loss(),
        )


def test_tree_core_attention_equals_the_dense_mask_and_builds_none(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """trainer.megatron_attention=tree (the default) gives Megatron's own dense-mask attention's
    log-probs, loss and gradients on tree-packed micro-batches without ever forming the dense mask."""
    from gyre_ray.model.tree_layout import TreeLayout

    folder = hf_folder(tmp_path, tied=False)
    torch_trainer, tree = trainers(folder)
    section = TrainerSection(backend="megatron", megatron_attention="dense", **SECTION)
    dense = make_trainer(section, *load_hf(folder), gspo_loss())
    assert type(tree.model.decoder.layers[0].self_attention.core_attention).__name__ == "TreeCoreAttention"
    assert type(dense.model.decoder.layers[0].self_attention.core_attention).__name__ == "DotProductAttention"
    batches = packed_batches(torch_trainer)
    assert any(isinstance(b.attention_mask, TreeLayout) and is_tree(b) for b in batches)
    cases = batches + [plain_batch()]
    expected = [dense.compute_logprobs(batch) for batch in cases]
    losses = [dense.forward_backward(batch)["loss"] for batch in batches]
    monkeypatch.setattr(TreeLayout, "dense", lambda *a, **k: pytest.fail("the tree path built a dense mask"))
    for batch, want in zip(cases, expected, strict=True):
        assert float((tree.compute_logprobs(batch) - want).abs().max()) < 1e-5
    # on-policy, the loss is ~0 (ratio 1, a group's advantages sum to 0): float32 noise of ~1e-7 is
    # all it holds; the gradients below are the comparison that matters
    for batch, loss in zip(batches, losses, strict=True):
        assert tree.forward_backward(batch)["loss"] == pytest.approx(loss, rel=1e-5, abs=1e-6)
    assert max_relative_error(dense.export_grads(), tree.export_grads()) < 1e-5


def test_a_bfloat16_model_is_stepped_through_float32_master_weights(tmp_path: Path) -> None:
    """As the torch trainer (tests/test_trainer_torch.py): AdamW on bfloat16 weights in place rounded
    most lr-1e-5 updates away; the cluster job (jobs/configs/cluster.yaml) trains exactly that way."""
    folder = hf_folder(tmp_path, tied=False)
    model, args = load_hf(folder)
    section = TrainerSection(backend="megatron", lr=1e-5, grad_clip=0.0)
    trainer = make_trainer(section, model.to(torch.bfloat16), args, lambda lp, b: (-lp.sum(), {}))
    assert trainer.master is not None and any(p.dtype == torch.bfloat16 for p in trainer.params.values())
    start = {k: v.detach().float().clone() for k, v in trainer.params.items()}
    for _ in range(3):
        trainer.forward_backward(plain_batch())
        trainer.optimizer_step(1.0)
    moved = total = 0
    for name, param in trainer.params.items():
        master = trainer.master.master[name]
        assert torch.equal(param, master.to(param.dtype)), name  # (Megatron keeps its norms in float32)
        delta = (master - start[name]).abs()
        moved, total = moved + int((delta > 2e-5).sum()), total + delta.numel()
    assert moved / total > 0.6, f"only {moved}/{total} master weights moved"  # in place: 15%
    trainer.save(tmp_path / "ckpt")
    resumed = make_trainer(
        section.model_copy(update={"lr": 1e-4}), load_hf(folder)[0].to(torch.bfloat16), args, trainer.loss_fn
    )
    resumed.load(tmp_path / "ckpt")
    assert all(torch.equal(resumed.master.master[k], v) for k, v in trainer.master.master.items())
    assert resumed.optimizer.param_groups[0]["lr"] == 1e-4  # the resume's setting, not the checkpoint's
