"""Context parallelism for the Megatron trainer: a micro-batch's columns split among ranks.

A long agent execution is one row of the packed micro-batch (its contexts after a compaction stay in
one root), so its activations grow with the row, whatever the tree attention saves on the mask. With
`trainer.context_parallel_size = C`, each of C ranks (per tensor-parallel rank) takes an equal share
of the columns and runs the embedding, every layer and the LM head on it alone. A query attends to
the keys of its ancestors and of its own segment up to itself, so columns late in a branch cost far
more than early ones, and a contiguous share late in a row has the most. `trainer.context_parallel_split`
says which columns each rank takes (`split_columns`, from the micro-batch's layout):

- `balanced` (default): the row (padded) cut into C x k equal chunks, k = 2 to 8 by its length; the
  chunks dealt out heaviest first by their attention work (`column_work`), each to the least loaded
  rank that still takes one (on causal rows at k = 2 that is the zigzag);
- `zigzag`: 2C chunks, rank r takes chunks r and 2C - 1 - r (even on causal rows only: on a tree row,
  whose late columns may be a branch that sees little, it is not);
- `contiguous`: rank r takes [r T / C, (r + 1) T / C).

(How evenly each split loads the ranks on a long execution's row: docs/megatron.md,
`benchmarks/bench_megatron_cp_split.py`.) Then, on every rank:

- attention: each layer's `TreeCoreAttention` gathers the keys and values of all the columns from
  the group in column order (`gather_columns`; its backward sums the gradients the other ranks'
  queries sent to this rank's keys and values) and attends this rank's queries over them, planned for
  its query ranges (`plan_tree(..., queries=ranges)`): keys and values, not activations, are what is
  whole per rank;
- log-probs: a token is scored at its parent's column (`token_logprobs`'s contract), which may be
  another rank's; each rank runs the LM head only on the columns it holds that predict a scored
  token (`local_parents`; in training, the loss tokens alone) and the group sums the (B, T) result
  (`sum_across`; its backward hands each rank the whole gradient, since every rank computes the
  same loss from the same sum): no rank holds a share's logits over the vocabulary;
- gradients: every rank's parameters saw only its columns: the trainer sums them over the group.

Padding columns are a chain of their own that no token is scored from (parent -1), so the result is
the unsplit one's (tested against context parallel 1).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist

from gyre_ray.model.tree_attention import TreePlan
from gyre_ray.model.tree_layout import TreeLayout
from gyre_ray.trainers.batch import MicroBatch


class _GatherColumns(torch.autograd.Function):
    """All ranks' equal shares of dim 0, put back in column order; backward: this rank's columns of the
    group's summed gradient."""

    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, split: ColumnSplit) -> torch.Tensor:
        ctx.split = split
        x = x.contiguous()  # (and so are its peers: collectives take dense tensors)
        parts = [torch.empty_like(x) for _ in range(dist.get_world_size(split.group))]
        dist.all_gather(parts, x, group=split.group)
        gathered = torch.cat(parts, dim=0)  # rank after rank: each rank's columns in its own order
        return gathered if split.in_rank_order else gathered.index_select(0, split.unshuffle)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor, None]:
        split = ctx.split
        grad = grad.contiguous()
        dist.all_reduce(grad, group=split.group)
        return grad.index_select(0, split.columns), None


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


def gather_columns(x: torch.Tensor, split: ColumnSplit) -> torch.Tensor:
    """`x` ([columns, ...], this rank's share of `split`) with every rank's columns, in column order."""
    return _GatherColumns.apply(x, split)


def sum_across(x: torch.Tensor, group: Any) -> torch.Tensor:
    """The sum of `x` over `group`, differentiable as one rank's share of a loss every rank computes."""
    return _SumAcross.apply(x, group)


SPLITS = ("balanced", "zigzag", "contiguous")
BALANCED_CHUNK_COLUMNS = (
    512  # a balanced split cuts a row into chunks of about this many columns (2-8 per rank)
)


def chunks_per_rank(length: int, ranks: int, split: str) -> int:
    """How many equal chunks of the row each rank takes: 1 contiguous, 2 zigzag, 2-8 balanced (more on
    longer rows: finer chunks even out more, each costs a few more attention blocks)."""
    if split not in SPLITS:
        raise ValueError(f"context-parallel split {split!r} is not one of {SPLITS}")
    if split == "contiguous":
        return 1
    if split == "zigzag":
        return 2
    return min(8, max(2, length // (ranks * BALANCED_CHUNK_COLUMNS)))


def column_work(layout: TreeLayout) -> torch.Tensor:
    """(width,) the keys each column's query attends to, summed over the rows: its ancestors' columns and
    its own segment's up to itself (a padding column: itself)."""
    work = torch.zeros(layout.width, dtype=torch.float64)
    for r, segments in enumerate(layout.rows):
        before: list[int] = []  # per segment: its ancestors' columns
        for start, stop, parent in segments:
            seen = 0 if parent < 0 else before[parent] + segments[parent][1] - segments[parent][0]
            before.append(seen)
            work[start:stop] += seen + torch.arange(1, stop - start + 1, dtype=torch.float64)
        work[layout.real_length(r) :] += 1
    return work


def split_columns(
    layout: TreeLayout, ranks: int, split: str, chunks: int
) -> list[tuple[tuple[int, int], ...]]:
    """Every rank's columns of `layout` (its width a multiple of ranks x `chunks`), ascending ranges:
    `contiguous` one run each; `zigzag` chunks r and 2 ranks - 1 - r; `balanced` the chunks dealt out
    heaviest first (`column_work`), each to the least loaded rank that still takes one."""
    size = layout.width // (ranks * chunks)
    if size * ranks * chunks != layout.width:
        raise ValueError(f"a {split} split of {ranks} ranks needs a width that is a multiple of "
                         f"{ranks * chunks}, got {layout.width}")  # fmt: skip
    if split == "contiguous":
        owned = [[r] for r in range(ranks)]
    elif split == "zigzag":
        owned = [[r, 2 * ranks - 1 - r] for r in range(ranks)]
    else:
        work = (
            column_work(layout).view(ranks * chunks, size).sum(dim=1).tolist()
            if size
            else [0.0] * (ranks * chunks)
        )
        owned = [[] for _ in range(ranks)]
        load = [0.0] * ranks
        for chunk in sorted(range(ranks * chunks), key=lambda c: (-work[c], c)):
            rank = min((r for r in range(ranks) if len(owned[r]) < chunks), key=lambda r: (load[r], r))
            owned[rank].append(chunk)
            load[rank] += work[chunk]
    return [_merged(sorted(chunk_ids), size) for chunk_ids in owned]


def _merged(chunk_ids: list[int], size: int) -> tuple[tuple[int, int], ...]:
    """Ascending chunks as column ranges, neighbours joined."""
    ranges: list[tuple[int, int]] = []
    for c in chunk_ids:
        if ranges and ranges[-1][1] == c * size:
            ranges[-1] = (ranges[-1][0], (c + 1) * size)
        else:
            ranges.append((c * size, (c + 1) * size))
    return tuple(ranges)


@dataclass(frozen=True)
class ColumnSplit:
    """How a micro-batch's columns lie among the group: this rank's `columns` (in its order) and, for the
    gathered tensor (every rank's columns, rank after rank), `unshuffle`, the gathered row of each column."""

    group: Any
    columns: torch.Tensor  # (width / ranks,) long, on the batch's device
    unshuffle: torch.Tensor  # (width,) long, on the batch's device
    in_rank_order: bool  # the gathered rows are the columns already (a contiguous split)


@dataclass(frozen=True)
class SharePlan:
    """What a context-parallel rank's layers get as their attention mask: the tree plan of its queries
    and how to gather every rank's keys and values (`TreeCoreAttention`)."""

    plan: TreePlan
    split: ColumnSplit


@dataclass(frozen=True)
class ColumnShare:
    """This rank's columns (`ranges`, ascending) of a micro-batch padded to `width` columns."""

    input_ids: torch.Tensor  # (B, width), padded with 0
    position_ids: torch.Tensor  # (B, width), padded with 0
    parent_index: torch.Tensor  # (B, width), padded with -1 (no token scored there)
    layout: TreeLayout  # the rows' segments; padding columns see only themselves
    ranges: tuple[tuple[int, int], ...]
    # index tensors on the batch's device (built once per micro-batch, used by every layer):
    columns: torch.Tensor  # (width / ranks,) long: the ranges' columns in order
    local: torch.Tensor  # (width,) long: a column's place among this rank's columns, -1 elsewhere
    unshuffle: torch.Tensor  # (width,) long: a column's row in the group's gathered shares
    length: int  # the micro-batch's own width (before padding)
    in_rank_order: bool  # every rank's columns are one run, in rank order (contiguous): no unshuffle

    def column_split(self, group: Any) -> ColumnSplit:
        return ColumnSplit(group, self.columns, self.unshuffle, self.in_rank_order)

    def padded(self, t: torch.Tensor, value: int) -> torch.Tensor:
        """`t` (B, length) of the micro-batch, padded with `value` to the share's width."""
        return _pad_columns(t, self.input_ids.size(1) - self.length, value)


def _pad_columns(t: torch.Tensor, pad: int, value: int) -> torch.Tensor:
    """`t` (B, T) with `pad` more columns of `value`."""
    return torch.nn.functional.pad(t, (0, pad), value=value) if pad else t


def share_of(batch: MicroBatch, ranks: int, rank: int, split: str = "balanced") -> ColumnShare:
    """Rank `rank`'s share of `batch`'s columns among `ranks` (`split_columns`; every rank computes the
    same split from the same batch); causal rows (no layout) count as one segment each. A dense
    (B, T, T) mask cannot be split: ValueError."""
    mask = batch.attention_mask
    rows, length = batch.input_ids.shape
    if mask is None:
        mask = TreeLayout(length, tuple(((0, length, -1),) if length else () for _ in range(rows)))
    if not isinstance(mask, TreeLayout):
        raise ValueError(
            "context parallelism needs the micro-batch's tree layout (or causal rows), not a dense mask"
        )
    chunks = chunks_per_rank(length, ranks, split)
    width = -(-length // (ranks * chunks)) * ranks * chunks
    pad = width - length

    layout = TreeLayout(width, mask.rows)
    assignment = split_columns(layout, ranks, split, chunks)
    device = batch.input_ids.device
    every = [torch.cat([torch.arange(lo, hi, device=device) for lo, hi in ranges]) for ranges in assignment]
    columns = every[rank]
    local = torch.full((width,), -1, dtype=torch.long, device=device)
    local[columns] = torch.arange(columns.numel(), device=device)
    unshuffle = torch.empty(width, dtype=torch.long, device=device)
    unshuffle[torch.cat(every)] = torch.arange(width, device=device)
    bounds = [edge for ranges in assignment for lo, hi in ranges for edge in (lo, hi)]
    in_rank_order = bounds == sorted(bounds)  # rank after rank, the columns in order: unshuffle is arange
    return ColumnShare(
        _pad_columns(batch.input_ids, pad, 0),
        _pad_columns(batch.position_ids, pad, 0),
        _pad_columns(batch.parent_index, pad, -1),
        layout,
        assignment[rank],
        columns,
        local,
        unshuffle,
        length,
        in_rank_order,
    )


def local_parents(share: ColumnShare) -> torch.Tensor:
    """(B, width) each token's parent as a place among this rank's columns; -1 where it has none or
    another rank holds it: `token_logprobs`' parent index for this rank's hidden states (B, its
    columns, H), so this rank scores exactly the tokens whose parent it holds."""
    parent = share.parent_index
    local = share.local[parent.clamp(min=0)]  # -1 where another rank holds the parent
    return torch.where(parent >= 0, local, torch.full_like(local, -1))
