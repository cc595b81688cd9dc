"""Which columns each context-parallel rank takes (`context_parallel.split_columns` / `share_of`):
every column once, equal shares, the group's gathered shares put back in column order; the zigzag
split evens the attention work of a causal row, and the balanced one that of a tree row too (a
contiguous split gives the last ranks the late, expensive queries; a zigzag one misjudges a late
branch that sees little)."""

from __future__ import annotations

import pytest
import torch

from gyre_ray.model.tree_attention import plan_tree
from gyre_ray.model.tree_layout import TreeLayout
from gyre_ray.trainers.batch import MicroBatch, sequential_parent_index, target_logprobs
from gyre_ray.trainers.megatron.context_parallel import (
    chunks_per_rank,
    column_work,
    local_parents,
    share_of,
    split_columns,
)

SPLITS = ("balanced", "zigzag", "contiguous")


def causal_batch(rows: int, length: int) -> MicroBatch:
    return MicroBatch(
        torch.arange(rows * length).view(rows, length) % 250 + 1,
        torch.arange(length).expand(rows, length).clone(),
        sequential_parent_index(rows, length),
    )


def tree_batch(segments: tuple[tuple[int, int, int], ...]) -> MicroBatch:
    width = segments[-1][1]
    parent = torch.arange(-1, width - 1)[None].clone()
    for start, _, up in segments:  # a segment's first token is scored at its parent's last column
        parent[0, start] = segments[up][1] - 1 if up >= 0 else -1
    return MicroBatch(
        torch.ones(1, width, dtype=torch.long),
        torch.arange(width)[None],
        parent,
        TreeLayout(width, (segments,)),
    )


@pytest.mark.parametrize("split", SPLITS)
@pytest.mark.parametrize(("length", "ranks"), [(19, 2), (64, 4), (50, 8), (9000, 4)])
def test_every_column_is_one_ranks_and_comes_back_in_order(split: str, length: int, ranks: int) -> None:
    shares = [share_of(causal_batch(2, length), ranks, r, split) for r in range(ranks)]
    width = shares[0].layout.width
    assert length <= width < length + ranks * chunks_per_rank(length, ranks, split)
    owned = torch.cat([s.columns for s in shares])  # what all_gather of the column numbers gives
    assert sorted(owned.tolist()) == list(range(width))  # each column on exactly one rank
    assert len({s.columns.numel() for s in shares}) == 1  # equal shares (all_gather needs them)
    assert torch.equal(owned[shares[0].unshuffle], torch.arange(width))
    for share in shares:
        assert torch.equal(share.local[share.columns], torch.arange(share.columns.numel()))
        assert int((share.local >= 0).sum()) == share.columns.numel()
        assert all(a[1] < b[0] for a, b in zip(share.ranges, share.ranges[1:], strict=False))  # merged
        plan = plan_tree(share.layout, heads=4, queries=share.ranges)  # its plan's queries, in order
        assert plan.q_len == share.columns.numel()


@pytest.mark.parametrize("split", SPLITS)
@pytest.mark.parametrize("ranks", [2, 4])
def test_each_loss_token_is_scored_once_from_the_rank_holding_its_predictor(split: str, ranks: int) -> None:
    """Every rank runs the LM head on its own columns for the scored tokens whose parent it holds
    (`local_parents`): over the ranks each loss token is scored exactly once, from its parent's
    hidden state, so the group's sum equals one rank scoring the whole micro-batch."""
    batch = tree_batch(((0, 40, -1), (40, 55, 0), (55, 71, 0), (71, 90, 2)))
    batch.input_ids = torch.randint(0, 50, batch.input_ids.shape, generator=torch.Generator().manual_seed(1))
    length = batch.input_ids.size(1)
    loss = torch.zeros_like(batch.input_ids)
    loss[0, 20:40] = loss[0, 47:55] = loss[0, 80:90] = 1  # the model's own outputs, say
    gen = torch.Generator().manual_seed(2)
    hidden, head = torch.randn(1, length, 8, generator=gen), torch.randn(50, 8, generator=gen)
    whole = target_logprobs(hidden, head, batch.input_ids, batch.parent_index, wanted=loss)
    summed, scored = torch.zeros_like(whole), torch.zeros_like(loss)
    for rank in range(ranks):
        share = share_of(batch, ranks, rank, split)
        parents = local_parents(share)
        wanted = share.padded(loss, 0)
        here = (parents >= 0) & wanted.bool()
        scored += here[:, :length].long()
        rows, cols = here.nonzero(as_tuple=True)  # each read at its own parent's column
        assert torch.equal(share.columns[parents[rows, cols]], share.parent_index[rows, cols])
        hidden_here = share.padded(hidden.transpose(1, 2), 0).transpose(1, 2)[:, share.columns]
        summed += target_logprobs(hidden_here, head, share.input_ids, parents, wanted=wanted)[:, :length]
    assert torch.equal(scored, loss * (batch.parent_index >= 0))  # each loss token once, no other
    assert torch.allclose(summed, whole, atol=1e-6) and bool(whole[loss.bool()].lt(0).all())


def imbalance(batch: MicroBatch, ranks: int, split: str) -> float:
    """The busiest rank's attention pairs over the mean rank's."""
    work = []
    for rank in range(ranks):
        share = share_of(batch, ranks, rank, split)
        work.append(plan_tree(share.layout, heads=4, queries=share.ranges).visited_pairs)
    return max(work) / (sum(work) / ranks)


def test_a_causal_row_is_evened_by_zigzag_and_balanced() -> None:
    batch = causal_batch(1, 4096)
    assert imbalance(batch, 8, "contiguous") > 1.7  # the last rank's queries see almost every key
    assert imbalance(batch, 8, "zigzag") < 1.05 and imbalance(batch, 8, "balanced") < 1.05


def test_a_tree_row_is_evened_by_balanced_only() -> None:
    """A long main path, then a sub-agent branch off its start: the branch's late columns see little."""
    batch = tree_batch(((0, 600, -1), (600, 4600, 0), (4600, 8192, 0)))
    assert column_work(batch.attention_mask)[8191] == 600 + 3592  # the root and its own segment
    assert imbalance(batch, 4, "zigzag") > 1.2
    assert imbalance(batch, 4, "balanced") < 1.05


def test_balanced_deals_a_causal_row_as_zigzag_does() -> None:
    """Two chunks a rank on a causal row: the heaviest chunk goes with the lightest, as zigzag pairs them."""
    for ranks in (2, 4, 8):
        layout = TreeLayout(ranks * 2 * 16, (((0, ranks * 2 * 16, -1),),))
        balanced = split_columns(layout, ranks, "balanced", 2)
        assert sorted(balanced) == sorted(split_columns(layout, ranks, "zigzag", 2))


def test_an_unknown_split_or_a_width_that_does_not_divide_is_named() -> None:
    with pytest.raises(ValueError, match="'stripes' is not one of"):
        chunks_per_rank(16, 2, "stripes")
    with pytest.raises(ValueError, match="multiple of 4"):
        split_columns(TreeLayout(18, (((0, 18, -1),),)), 2, "zigzag", 2)
