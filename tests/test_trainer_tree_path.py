"""The trainer's fast path (block-sparse tree attention + chunked target log-probs) keeps numerics:
log-probs equal today's dense-mask, full-logits path within 1e-5, parameter gradients within 1e-5
relative to their largest entry."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from torch.nn.attention import SDPBackend, sdpa_kernel

from gyre_ray.model import attention, qwen3
from gyre_ray.model.arch import ModelArgs
from gyre_ray.model.qwen3 import Qwen3ForCausalLM, init_weights
from gyre_ray.trainers import batch as batch_module
from gyre_ray.trainers.batch import MicroBatch, model_logprobs, target_logprobs, token_logprobs
from tests.test_model_attention import ROW_A, ROW_B, dense_reference, tree_mask

TOL = 1e-5
ARGS = ModelArgs(
    vocab_size=300,
    hidden_size=64,
    intermediate_size=128,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    head_dim=16,
    max_position_embeddings=512,
)


def tree_batch(width: int = 180) -> MicroBatch:
    """Two tree-packed rows: ids, depth positions, parent columns and the ancestor mask."""
    g = torch.Generator().manual_seed(5)
    ids = torch.randint(0, ARGS.vocab_size, (2, width), generator=g)
    positions = torch.zeros(2, width, dtype=torch.long)
    parents = torch.full((2, width), -1, dtype=torch.long)
    masks = []
    for r, segments in enumerate((ROW_A, ROW_B)):
        for start, stop, parent in segments:
            base = 0 if parent < 0 else int(positions[r, segments[parent][1] - 1]) + 1
            positions[r, start:stop] = torch.arange(base, base + stop - start)
            parents[r, start:stop] = torch.arange(start - 1, stop - 1)
            parents[r, start] = -1 if parent < 0 else segments[parent][1] - 1
        masks.append(tree_mask(width, segments))
    return MicroBatch(ids, positions, parents, torch.stack(masks))


def old_attend(q, k, v, mask, past_len):
    if mask is None:
        with sdpa_kernel([SDPBackend.MATH]):
            groups = q.size(1) // k.size(1)
            return F.scaled_dot_product_attention(
                q, k.repeat_interleave(groups, 1), v.repeat_interleave(groups, 1), is_causal=q.size(2) > 1
            )
    return dense_reference(q, k, v, mask)


def grads_of(model, logprobs):
    model.zero_grad(set_to_none=True)
    weights = torch.linspace(-1.0, 1.0, logprobs.numel()).view_as(logprobs)
    (logprobs * weights).sum().backward()
    return {n: p.grad.clone() for n, p in model.named_parameters()}


@pytest.mark.parametrize("keep_probs", [True, False])
def test_chunked_target_logprobs_equal_full_logits_values_and_gradients(monkeypatch, keep_probs):
    if not keep_probs:
        monkeypatch.setattr(batch_module, "KEEP_PROBS_ELEMENTS", 0)  # recompute logits in backward
    g = torch.Generator().manual_seed(1)
    hidden = torch.randn(2, 23, 16, generator=g, requires_grad=True)
    weight = torch.randn(50, 16, generator=g, requires_grad=True)
    ids = torch.randint(0, 50, (2, 23), generator=g)
    parents = torch.arange(23).expand(2, 23) - 1
    parents = parents.clone()
    parents[1, 10] = 3  # a branch: column 10 is predicted from column 3
    results = []
    for fn in (
        lambda: target_logprobs(hidden, weight, ids, parents, chunk_tokens=7),
        lambda: token_logprobs(hidden @ weight.t(), ids, parents),
    ):
        hidden.grad = weight.grad = None
        out = fn()
        weights = torch.linspace(-2.0, 1.0, out.numel()).view_as(out)
        weights[0, 5:12] = 0.0  # tokens outside the loss: the backward skips them
        (out * weights).sum().backward()
        results.append((out.detach(), hidden.grad.clone(), weight.grad.clone()))
    for got, want in zip(*results, strict=True):
        assert (got - want).abs().max() <= TOL
    assert results[0][0][:, 0].abs().max() == 0  # no predecessor: 0


def test_tree_packed_logprobs_and_gradients_equal_the_dense_mask_path(monkeypatch):
    model = init_weights(Qwen3ForCausalLM(ARGS), seed=0, std=0.1)
    batch = tree_batch()
    monkeypatch.setattr(attention, "BLOCK_QUERIES", 16)
    new = model_logprobs(model, batch)
    new_grads = grads_of(model, new)
    with monkeypatch.context() as old:
        old.setattr(qwen3, "attend", old_attend)
        old.setattr(Qwen3ForCausalLM, "_attention_plan", lambda self, mask, *_: mask)
        reference = token_logprobs(
            model(batch.input_ids, batch.position_ids, batch.attention_mask),
            batch.input_ids,
            batch.parent_index,
        )
        old_grads = grads_of(model, reference)
    assert (new - reference).abs().max() <= TOL
    for name, grad in old_grads.items():  # sums over ~360 tokens: 1e-5 relative to the largest entry
        assert (new_grads[name] - grad).abs().max() <= TOL * max(1.0, float(grad.abs().max())), name
