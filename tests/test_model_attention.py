"""Block-sparse tree attention: same outputs and gradients as one dense masked kernel call, fewer pairs."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from torch.nn.attention import SDPBackend, sdpa_kernel

from gyre_ray.model import attention
from gyre_ray.model.attention import attend, plan_attention, plan_causal, planned_attention

TOL = 1e-5


def tree_mask(width: int, segments: list[tuple[int, int, int]]) -> torch.Tensor:
    """(width, width) mask of a packed tree: segment (start, stop, parent segment or -1); the rest see nothing."""
    mask = torch.zeros(width, width, dtype=torch.bool)
    for start, stop, parent in segments:
        if parent >= 0:
            mask[start:stop] |= mask[segments[parent][1] - 1]
        mask[start:stop, start:stop] = torch.ones(stop - start, stop - start, dtype=torch.bool).tril()
    return mask


def dense_reference(q, k, v, mask):
    """Today's path: the whole mask in one math-kernel call, rows that see nothing zeroed."""
    dead = ~mask.any(-1, keepdim=True)
    groups = q.size(1) // k.size(1)
    with sdpa_kernel([SDPBackend.MATH]):
        out = F.scaled_dot_product_attention(
            q,
            k.repeat_interleave(groups, 1),
            v.repeat_interleave(groups, 1),
            attn_mask=(mask | dead).unsqueeze(1),
        )
    return out.masked_fill(dead.unsqueeze(1), 0.0)


def qkv(batch: int, t: int, s: int, seed: int = 0):
    g = torch.Generator().manual_seed(seed)
    q = torch.randn(batch, 4, t, 16, generator=g, requires_grad=True)
    k = torch.randn(batch, 2, s, 16, generator=g, requires_grad=True)
    v = torch.randn(batch, 2, s, 16, generator=g, requires_grad=True)
    return q, k, v


def values_and_grads(fn, q, k, v):
    for x in (q, k, v):
        x.grad = None
    out = fn()
    weights = torch.linspace(-1.0, 1.0, out.numel()).view_as(out)
    (out * weights).sum().backward()
    return [out.detach()] + [x.grad.clone() for x in (q, k, v)]


@pytest.fixture
def small_blocks(monkeypatch):
    monkeypatch.setattr(attention, "BLOCK_QUERIES", 16)


# Two rows: a prefix with three branches (one nested), side-by-side samples, trailing pads.
ROW_A = [(0, 40, -1), (40, 70, 0), (70, 100, 0), (100, 120, 2), (120, 150, -1), (150, 170, 4)]
ROW_B = [(0, 25, -1), (25, 90, 0), (90, 160, -1), (160, 175, 2)]


def test_tree_plan_matches_dense_masked_attention_values_and_gradients(small_blocks):
    width = 180
    mask = torch.stack([tree_mask(width, ROW_A), tree_mask(width, ROW_B)])
    mask[1, 178, 178] = True  # a pad column that sees itself, as the trajectory packer lays them out
    q, k, v = qkv(2, width, width)
    plan = plan_attention(mask, heads=4)
    got = values_and_grads(lambda: planned_attention(q, k, v, plan), q, k, v)
    want = values_and_grads(lambda: dense_reference(q, k, v, mask), q, k, v)
    for g, w in zip(got, want, strict=True):
        assert (g - w).abs().max() <= TOL
    assert got[0][:, :, 176:178].abs().max() == 0  # rows that see nothing output zeros


def test_tree_plan_reads_at_most_the_causal_pairs_and_gathers_scattered_keys(small_blocks):
    width = 512
    segments = [(0, 64, -1)] + [(64 + 112 * i, 64 + 112 * (i + 1), 0) for i in range(4)]
    plan = plan_attention(tree_mask(width, segments)[None])
    causal_pairs = width * (width + 1) // 2
    assert plan.visited_pairs <= causal_pairs
    assert plan.visited_pairs < 0.7 * causal_pairs  # sibling branches are skipped, not masked
    assert any(isinstance(b.keys, torch.Tensor) for b in plan.blocks)  # prefix + own branch: a gather


def test_causal_plan_after_a_past_equals_the_full_mask(small_blocks):
    past, t = 50, 37
    q, k, v = qkv(1, t, past + t, seed=3)
    mask = (torch.arange(past + t) <= torch.arange(past, past + t)[:, None])[None]
    got = values_and_grads(lambda: attend(q, k, v, None, past), q, k, v)
    want = values_and_grads(lambda: dense_reference(q, k, v, mask), q, k, v)
    for g, w in zip(got, want, strict=True):
        assert (g - w).abs().max() <= TOL
    plan = plan_causal(t, past, torch.device("cpu"))
    assert plan.visited_pairs < t * (past + t)  # the upper triangle of the new block is skipped


def test_plan_rejects_a_mismatched_or_non_bool_mask():
    with pytest.raises(ValueError, match="bool"):
        plan_attention(torch.ones(1, 4, 4))
    q, k, v = qkv(1, 4, 4)
    with pytest.raises(ValueError, match="plan is for"):
        planned_attention(q, k, v, plan_attention(torch.ones(1, 5, 5, dtype=torch.bool)))
