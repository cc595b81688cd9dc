"""Megatron's core attention replaced by gyre-ray's planned attention, so a tree row needs no dense mask.

Megatron's `DotProductAttention` (and Transformer Engine's, with an "arbitrary" mask) take the tree as
an explicit `[B, 1, T, T]` mask: T^2 bytes a row before any attention runs, and T^2 scores per head
in the local kernel. A long agent execution is one row (a 405k-token row's mask alone is 153 GiB),
so with `trainer.megatron_attention=tree` (the default) each layer's `core_attention` is a
`TreeCoreAttention`: the trainer plans the micro-batch once from its `TreeLayout`
(`gyre_ray.model.tree_attention.plan_tree`, memory linear in the row) and hands the plan down the
decoder in place of the mask; every layer attends its own projections (already normed and rotated
by Megatron, this rank's heads under tensor parallelism) through it. Rows with no layout (causal)
or a dense mask are planned by `gyre_ray.model.attention` the same way the torch model does.

Under context parallelism (`context_parallel.py`) a rank holds a share of the columns: the trainer
hands down a `SharePlan`, the plan of its queries and how the group's keys and values are gathered
back into column order before it is followed.

Megatron's own attention is kept for `trainer.megatron_attention=dense`.
"""

from __future__ import annotations

import math
from typing import Any

import torch

from gyre_ray.model.attention import AttentionPlan, attend
from gyre_ray.model.tree_attention import TreePlan, tree_attention
from gyre_ray.trainers.megatron.context_parallel import SharePlan, gather_columns

Plan = TreePlan | AttentionPlan | SharePlan


class TreeCoreAttention(torch.nn.Module):
    """A Megatron `core_attention` module: q [sq, b, np, hn], k/v [sk, b, ng, hn] -> [sq, b, np * hn],
    following the plan the trainer passes as `attention_mask` (see the module docstring)."""

    def __init__(
        self,
        config: Any,
        layer_number: int,
        attn_mask_type: Any,
        attention_type: str,
        attention_dropout: float | None = None,
        softmax_scale: float | None = None,
        cp_comm_type: str | None = None,
        pg_collection: Any = None,
    ) -> None:
        super().__init__()
        dropout = config.attention_dropout if attention_dropout is None else attention_dropout
        if dropout:
            raise ValueError(f"tree core attention has no attention dropout (got {dropout})")
        if softmax_scale is not None and not math.isclose(softmax_scale, 1 / math.sqrt(config.kv_channels)):
            raise ValueError(
                f"tree core attention scales scores by 1/sqrt(head_dim); softmax_scale={softmax_scale} "
                "needs trainer.megatron_attention=dense"
            )
        self.layer_number = layer_number

    def forward(
        self,
        query: torch.Tensor,
        key: torch.Tensor,
        value: torch.Tensor,
        attention_mask: Plan,
        attn_mask_type: Any = None,
        attention_bias: torch.Tensor | None = None,
        packed_seq_params: Any = None,
    ) -> torch.Tensor:
        if isinstance(attention_mask, SharePlan):
            # context parallel: this rank holds a share of k, v; one gather brings every rank's
            kv = gather_columns(torch.cat((key, value), dim=-1), attention_mask.split)
            key, value = kv.chunk(2, dim=-1)
            attention_mask = attention_mask.plan
        if not isinstance(attention_mask, (TreePlan, AttentionPlan)):
            raise TypeError(
                "tree core attention needs the micro-batch's plan as attention_mask (`gyre_ray.model.qwen3.plan_mask`), "
                f"got {type(attention_mask).__name__}"
            )
        if attention_bias is not None or packed_seq_params is not None:
            raise ValueError("tree core attention takes neither an attention bias nor packed-sequence params")
        q, k, v = (x.permute(1, 2, 0, 3) for x in (query, key, value))  # [b, heads, s, hn]
        if isinstance(attention_mask, TreePlan):
            out = tree_attention(q, k, v, attention_mask)
        else:
            out = attend(q, k, v, attention_mask, 0)
        sq, b, heads, dim = query.shape
        return out.permute(2, 0, 1, 3).reshape(sq, b, heads * dim)
