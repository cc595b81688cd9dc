"""Context parallelism for the Megatron trainer: a micro-batch's columns split among ranks.

A long agent execution is one row of the packed micro-batch (its contexts after a compaction stay in
one root), so its activations grow with the row, whatever the tree attention saves on the mask. With
`trainer.context_parallel_size = C`, each of C ranks (per tensor-parallel rank) takes one contiguous
share of the columns, [r T / C, (r + 1) T / C) after padding T to a multiple of C, and runs the
embedding, every layer and the LM head on it alone:

- attention: each layer's `TreeCoreAttention` gathers the keys and values of all the columns from
  the group (`gather_columns`; its backward sums the gradients the other ranks' queries sent to this
  rank's keys and values) and attends this rank's queries over them, planned for its query range
  (`plan_tree(..., queries=(lo, hi))`): keys and values, not activations, are what is whole per rank;
- log-probs: a token is scored at its parent's column (`token_logprobs`'s contract), which may be
  another rank's; each rank scores the tokens whose parent it holds and the group sums the (B, T)
  result (`sum_across`; its backward hands each rank the whole gradient, since every rank computes
  the same loss from the same sum);
- gradients: every rank's parameters saw only its columns: the trainer sums them over the group.

Padding columns are a chain of their own that no token is scored from (parent -1), so the result is
the unsplit one's (tested against context parallel 1).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist

from gyre_ray.model.tree_layout import TreeLayout
from gyre_ray.trainers.batch import MicroBatch


class _GatherColumns(torch.autograd.Function):
    """All ranks' equal shares of dim 0, concatenated in rank order; backward: the summed gradient's share."""

    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, group: Any) -> torch.Tensor:
        ctx.group = group
        x = x.contiguous()  # (and so are its peers: collectives take dense tensors)
        parts = [torch.empty_like(x) for _ in range(dist.get_world_size(group))]
        dist.all_gather(parts, x, group=group)
        return torch.cat(parts, dim=0)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor, None]:
        grad = grad.contiguous()
        dist.all_reduce(grad, group=ctx.group)
        share = grad.size(0) // dist.get_world_size(ctx.group)
        rank = dist.get_rank(ctx.group)
        return grad[rank * share : (rank + 1) * share], None


class _SumAcross(torch.autograd.Function):
    """The group's sum; backward: the gradient unchanged (each rank's loss is the same function of it)."""

    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, group: Any) -> torch.Tensor:
        out = x.clone()
        dist.all_reduce(out, group=group)
        return out

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor, None]:
        return grad, None


def gather_columns(x: torch.Tensor, group: Any) -> torch.Tensor:
    """`x` ([columns, ...], this rank's share) with every rank's share in front and behind, in rank order."""
    return _GatherColumns.apply(x, group)


def sum_across(x: torch.Tensor, group: Any) -> torch.Tensor:
    """The sum of `x` over `group`, differentiable as one rank's share of a loss every rank computes."""
    return _SumAcross.apply(x, group)


@dataclass(frozen=True)
class ColumnShare:
    """This rank's columns [lo, hi) of a micro-batch padded to `width` columns (a multiple of the ranks)."""

    input_ids: torch.Tensor  # (B, width), padded with 0
    position_ids: torch.Tensor  # (B, width), padded with 0
    parent_index: torch.Tensor  # (B, width), padded with -1 (no token scored there)
    layout: TreeLayout  # the rows' segments; padding columns see only themselves
    lo: int
    hi: int
    length: int  # the micro-batch's own width (before padding)


def share_of(batch: MicroBatch, ranks: int, rank: int) -> ColumnShare:
    """Rank `rank`'s share of `batch`'s columns among `ranks`; causal rows (no layout) count as one
    segment each. A dense (B, T, T) mask cannot be split: ValueError."""
    mask = batch.attention_mask
    rows, length = batch.input_ids.shape
    if mask is None:
        mask = TreeLayout(length, tuple(((0, length, -1),) if length else () for _ in range(rows)))
    if not isinstance(mask, TreeLayout):
        raise ValueError(
            "context parallelism needs the micro-batch's tree layout (or causal rows), not a dense mask"
        )
    width = -(-length // ranks) * ranks
    pad = width - length

    def padded(t: torch.Tensor, value: int) -> torch.Tensor:
        return torch.nn.functional.pad(t, (0, pad), value=value) if pad else t

    share = width // ranks
    return ColumnShare(
        padded(batch.input_ids, 0),
        padded(batch.position_ids, 0),
        padded(batch.parent_index, -1),
        TreeLayout(width, mask.rows),
        rank * share,
        (rank + 1) * share,
        length,
    )


def share_logprobs(logits: torch.Tensor, share: ColumnShare, group: Any) -> torch.Tensor:
    """(B, T) log-probs of the whole micro-batch from this rank's logits (B, hi - lo, V) over its
    columns: each token read at its parent's column where this rank holds it, summed over `group`."""
    ids, parent = share.input_ids, share.parent_index
    rows, width = ids.shape
    here = (parent >= share.lo) & (parent < share.hi)
    local = (parent - share.lo).clamp(0, share.hi - share.lo - 1)
    flat = (torch.arange(rows, device=ids.device)[:, None] * (share.hi - share.lo) + local).reshape(-1)
    logp = torch.log_softmax(
        logits.float() if logits.dtype in (torch.float16, torch.bfloat16) else logits, -1
    )
    picked = logp.reshape(-1, logp.size(-1))[flat, ids.reshape(-1)].view(rows, width)
    mine = torch.where(here, picked, torch.zeros_like(picked))
    return sum_across(mine, group)[:, : share.length]
