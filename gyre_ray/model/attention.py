"""Attention of the policy model: causal, padded and tree-masked, at (about) the cost of causal attention.

A tree-packed row (`gyre_ray.trajectory.batching`) or a chunked prefill after a cached past has an
arbitrary boolean mask; handing the whole (T, S) mask to one `scaled_dot_product_attention` call
makes the kernel compute every query x key block, visible or not (twice the work of causal
attention, more for sparse trees). Here the mask is turned once per forward into an
`AttentionPlan`: query blocks of `BLOCK_QUERIES` rows, each reading only the key columns some row
of the block can see (a contiguous slice where the visible columns are dense, a gathered index
otherwise), with the block's sub-mask only where it is not all-visible. The work is then about the
number of visible query x key pairs, which for a tree is at most that of causal attention over
the same tokens. Rows that see nothing (padding) output zeros.

The functions take plain tensors (q (B, Hq, T, D), k and v (B, Hkv, S, D), a (B, T, S) bool mask),
so another trainer backend can call `plan_attention` + `planned_attention` on its own projections.

On CPU, torch's default dispatch runs the math kernel whenever gradients are needed; `fused_sdpa`
asks for the fused flash kernel (same numerics within float32 rounding, several times faster).
"""

from __future__ import annotations

import contextlib
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch.nn.attention import SDPBackend, sdpa_kernel

# Query rows per block: small enough to skip most invisible keys, large enough to keep the kernel busy.
BLOCK_QUERIES = 128
# Upper bound on attention scores (batch x heads x query rows x keys) one block may materialise.
MAX_SCORES_PER_CHUNK = 1 << 25
# A block reads a contiguous key slice when at least this fraction of it is visible, else a gather.
DENSE_SLICE_FRACTION = 0.5
_SDPA_HAS_GQA = tuple(int(part) for part in torch.__version__.split(".")[:2]) >= (2, 5)  # enable_gqa


def fused_sdpa(device: torch.device) -> contextlib.AbstractContextManager:
    """Prefer the fused flash kernel on CPU (torch falls back to math for training otherwise)."""
    if device.type != "cpu":
        return contextlib.nullcontext()
    return sdpa_kernel([SDPBackend.FLASH_ATTENTION, SDPBackend.MATH])


@dataclass(frozen=True)
class QueryBlock:
    """Rows [start, stop) of the queries, the key columns they read and how they are masked."""

    start: int
    stop: int
    keys: slice | torch.Tensor  # key columns (a slice, or an index tensor for scattered columns)
    mask: torch.Tensor | None  # (B or 1, 1, rows, keys) bool, None when every row sees every key
    dead: torch.Tensor | None  # (B, 1, rows, 1) bool rows that see nothing (their output is zero)


@dataclass(frozen=True)
class AttentionPlan:
    """Query blocks covering `q_len` queries over `key_len` keys (built once, used by every layer)."""

    blocks: tuple[QueryBlock, ...]
    q_len: int
    key_len: int

    @property
    def visited_pairs(self) -> int:
        """Query x key pairs the kernel computes (per batch row and head)."""
        total = 0
        for block in self.blocks:
            keys = block.keys
            width = keys.stop - keys.start if isinstance(keys, slice) else int(keys.numel())
            total += (block.stop - block.start) * width
        return total


def _block_rows(batch: int, heads: int, key_len: int) -> int:
    return max(1, min(BLOCK_QUERIES, MAX_SCORES_PER_CHUNK // max(1, batch * heads * key_len)))


def plan_causal(
    q_len: int, past_len: int, device: torch.device, batch: int = 1, heads: int = 1
) -> AttentionPlan:
    """Plan of causal attention for `q_len` queries placed after `past_len` cached keys."""
    key_len = past_len + q_len
    rows = _block_rows(batch, heads, key_len)
    blocks = []
    for start in range(0, q_len, rows):
        stop = min(q_len, start + rows)
        width = past_len + stop
        query_pos = torch.arange(past_len + start, past_len + stop, device=device)
        mask = torch.arange(width, device=device) <= query_pos[:, None]
        blocks.append(QueryBlock(start, stop, slice(0, width), mask[None, None], None))
    return AttentionPlan(tuple(blocks), q_len, key_len)


def plan_attention(mask: torch.Tensor, heads: int = 1) -> AttentionPlan:
    """Plan for a (B, T, S) bool mask (True = may attend)."""
    if mask.dim() != 3 or mask.dtype != torch.bool:
        raise ValueError(
            f"attention mask must be (batch, queries, keys) bool, got {tuple(mask.shape)} {mask.dtype}"
        )
    batch, q_len, key_len = mask.shape
    rows = _block_rows(batch, heads, key_len)
    blocks = []
    for start in range(0, q_len, rows):
        stop = min(q_len, start + rows)
        sub = mask[:, start:stop]
        visible = sub.any(1).any(0).nonzero().squeeze(-1)
        if visible.numel() == 0:  # only padding rows: read one key, zero the output
            blocks.append(
                QueryBlock(start, stop, slice(0, 1), None, sub.new_ones((batch, 1, stop - start, 1)))
            )
            continue
        lo, hi = int(visible[0]), int(visible[-1]) + 1
        if visible.numel() >= DENSE_SLICE_FRACTION * (hi - lo):
            keys: slice | torch.Tensor = slice(lo, hi)
            sub = sub[:, :, lo:hi]
        else:
            keys = visible
            sub = sub.index_select(2, visible)
        dead = ~sub.any(-1, keepdim=True)
        dead_rows = dead.unsqueeze(1) if bool(dead.any()) else None
        if dead_rows is not None:
            sub = sub | dead
        blocks.append(QueryBlock(start, stop, keys, None if bool(sub.all()) else sub.unsqueeze(1), dead_rows))
    return AttentionPlan(tuple(blocks), q_len, key_len)


def sdpa_gqa(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, **kwargs) -> torch.Tensor:
    """`scaled_dot_product_attention` with grouped-query heads (fewer k/v heads than q heads)."""
    if k.size(1) != q.size(1):
        if _SDPA_HAS_GQA:
            kwargs["enable_gqa"] = True
        else:
            k = k.repeat_interleave(q.size(1) // k.size(1), dim=1)
            v = v.repeat_interleave(q.size(1) // v.size(1), dim=1)
    return F.scaled_dot_product_attention(q, k, v, **kwargs)


def planned_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, plan: AttentionPlan) -> torch.Tensor:
    """Attention of q (B, Hq, T, D) over k, v (B, Hkv, S, D) following `plan` -> (B, Hq, T, D)."""
    if q.size(2) != plan.q_len or k.size(2) != plan.key_len:
        raise ValueError(
            f"attention plan is for {plan.q_len} queries x {plan.key_len} keys, got {q.size(2)} x {k.size(2)}"
        )
    outputs = []
    with fused_sdpa(q.device):
        for block in plan.blocks:
            if isinstance(block.keys, slice):
                keys, values = k[:, :, block.keys], v[:, :, block.keys]
            else:
                keys, values = k.index_select(2, block.keys), v.index_select(2, block.keys)
            out = sdpa_gqa(q[:, :, block.start : block.stop], keys, values, attn_mask=block.mask)
            if block.dead is not None:
                out = out.masked_fill(block.dead, 0.0)
            outputs.append(out)
    return outputs[0] if len(outputs) == 1 else torch.cat(outputs, dim=2)


def attend(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    mask: torch.Tensor | AttentionPlan | None,
    past_len: int,
) -> torch.Tensor:
    """Scaled dot-product attention of q (B, Hq, T, D) over k, v (B, Hkv, S, D).

    mask: an `AttentionPlan`, a (B, T, S) bool mask (True = may attend), or None = causal with the T
    queries at the end of S. Query rows whose mask is all False (padding) return zeros.
    """
    if isinstance(mask, AttentionPlan):
        return planned_attention(q, k, v, mask)
    t = q.size(2)
    if mask is None and (past_len == 0 or t == 1):
        with fused_sdpa(q.device):
            return sdpa_gqa(q, k, v, is_causal=past_len == 0 and t > 1)
    if mask is not None and t == 1:  # one decode step over padded rows: no blocks to skip
        dead = ~mask.any(-1, keepdim=True)
        with fused_sdpa(q.device):
            out = sdpa_gqa(q, k, v, attn_mask=(mask | dead).unsqueeze(1))
        return out.masked_fill(dead.unsqueeze(1), 0.0) if bool(dead.any()) else out
    if mask is None:
        plan = plan_causal(t, past_len, q.device, q.size(0), q.size(1))
    else:
        plan = plan_attention(mask, q.size(1))
    return planned_attention(q, k, v, plan)
