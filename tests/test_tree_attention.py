"""Tree attention planned from segments (`TreeLayout` -> `plan_tree` -> `tree_attention`): the same
values and gradients as masked attention over the dense mask, memory linear in the row, and the
trajectory packer's micro-batches carry segments, not a (B, T, T) tensor."""

from __future__ import annotations

import pickle
import random

import pytest
import torch

from gyre_ray.model import tree_attention
from gyre_ray.model.qwen3 import Qwen3ForCausalLM, init_weights
from gyre_ray.model.tree_attention import plan_tree
from gyre_ray.model.tree_layout import TreeLayout
from gyre_ray.trainers.batch import MicroBatch, model_logprobs
from gyre_ray.trajectory.batching import micro_batches
from gyre_ray.trajectory.packing import pack_paths
from gyre_ray.trajectory.pieces import split_roots
from gyre_ray.trajectory.pipeline import process_execution
from gyre_ray.trajectory.synthetic import SyntheticWorkload, synthetic_execution
from tests.test_trainer_tree_path import ARGS, grads_of


def random_row(rng: random.Random, nodes: int, longest: int) -> tuple[tuple[int, int, int], ...]:
    """A random forest of `nodes` segments laid out depth first, as the trajectory packer does."""
    children: dict[int, list[int]] = {-1: []}
    for i in range(nodes):
        children.setdefault(rng.choice([-1, *range(i)]) if i else -1, []).append(i)
        children.setdefault(i, [])
    lengths = [rng.randint(1, longest) for _ in range(nodes)]
    segments: list[tuple[int, int, int]] = []

    def visit(node: int, parent_segment: int) -> None:
        start = segments[-1][1] if segments else 0
        segments.append((start, start + lengths[node], parent_segment))
        me = len(segments) - 1
        for child in children[node]:
            visit(child, me)

    for root in children[-1]:
        visit(root, -1)
    return tuple(segments)


def brute_force(q, k, v, mask):
    """softmax(q k^T / sqrt(d) masked) v with every score formed (float64 reference)."""
    groups = q.size(1) // k.size(1)
    k, v = k.repeat_interleave(groups, 1), v.repeat_interleave(groups, 1)
    scores = (q @ k.transpose(-1, -2)) / q.size(-1) ** 0.5
    return scores.masked_fill(~mask[:, None], float("-inf")).softmax(-1) @ v


def assert_same_gradients(got, want, inputs, generator) -> None:
    """`got` and `want` send the same gradients back to `inputs` (float64) for one random output grad."""
    out_grad = torch.randn(got.shape, generator=generator, dtype=torch.float64)
    for a, b in zip(
        torch.autograd.grad(got, inputs, out_grad, retain_graph=True),
        torch.autograd.grad(want, inputs, out_grad, retain_graph=True),
        strict=True,
    ):
        assert (a - b).abs().max() <= 1e-9


@pytest.mark.parametrize("seed", range(12))
def test_tree_plan_equals_dense_masked_attention_values_and_gradients(monkeypatch, seed):
    rng = random.Random(seed)
    monkeypatch.setattr(tree_attention, "BLOCK_QUERIES", rng.choice([5, 16, 128]))
    # odd seeds: every masked block recomputed in the backward pass (what long rows do)
    monkeypatch.setattr(tree_attention, "RECOMPUTE_ABOVE_MASK_BYTES", -1 if seed % 2 else 1 << 40)
    rows = tuple(
        random_row(rng, rng.randint(1, 12), rng.choice([3, 40, 150])) for _ in range(rng.randint(1, 3))
    )
    width = max(row[-1][1] for row in rows) + rng.randint(0, 20)  # padding in every shorter row
    layout = TreeLayout(width, rows)
    mask = layout.dense()
    g = torch.Generator().manual_seed(seed)
    q, k, v = (
        torch.randn(len(rows), heads, width, 8, generator=g, dtype=torch.float64, requires_grad=True)
        for heads in (4, 2, 2)
    )
    plan = plan_tree(layout, heads=4)
    assert plan.recompute == bool(seed % 2)
    got = tree_attention.tree_attention(q, k, v, plan)
    want = brute_force(q, k, v, mask)
    assert (got - want).abs().max() <= 1e-10
    assert_same_gradients(got, want, (q, k, v), g)
    assert layout.visible_pairs() == int(mask.sum())
    assert plan.visited_pairs >= layout.visible_pairs()  # every visible pair is computed


def long_chain(rng: random.Random, turns: int) -> tuple[tuple[int, int, int], ...]:
    """A long execution's row: a main chain of turns with a sub-agent branch every 40 turns."""
    segments: list[tuple[int, int, int]] = []
    last = -1
    for turn in range(turns):
        start = segments[-1][1] if segments else 0
        segments.append((start, start + rng.randint(200, 2000), last))
        me = len(segments) - 1
        if turn % 40 == 5:
            segments.append((segments[-1][1], segments[-1][1] + 3000, last))
        last = me
    return tuple(segments)


def test_a_long_row_plans_in_memory_linear_in_its_length():
    segments = long_chain(random.Random(0), 120)
    width = segments[-1][1]
    assert width > 100_000
    layout = TreeLayout(width, (segments,))
    plan = plan_tree(layout, heads=ARGS.num_attention_heads)
    blocks = plan.rows[0]
    rows = max(b.stop - b.start for b in blocks)
    # kept masks: at most a few rows x rows tiles (a block's own columns), never rows x the row
    assert plan.stored_mask_elements <= 2 * len(blocks) * rows * rows
    assert plan.stored_mask_elements < width * 64  # the dense mask would be width^2 (> 10^10 here)
    # and the kernel computes only what the tree lets each column see (branch straddles aside)
    assert plan.visited_pairs <= 1.01 * layout.visible_pairs()
    assert len(pickle.dumps(layout)) < 20 * len(segments) + 200


def test_the_model_gives_the_same_logprobs_and_gradients_from_segments_as_from_the_dense_mask(monkeypatch):
    rng = random.Random(3)
    rows = (random_row(rng, 9, 40), random_row(rng, 6, 60))
    width = max(row[-1][1] for row in rows) + 7
    layout = TreeLayout(width, rows)
    g = torch.Generator().manual_seed(4)
    ids = torch.randint(0, ARGS.vocab_size, (2, width), generator=g)
    positions = torch.zeros(2, width, dtype=torch.long)
    parents = torch.full((2, width), -1, dtype=torch.long)
    for r, segments in enumerate(rows):
        for start, stop, parent in segments:
            base = 0 if parent < 0 else int(positions[r, segments[parent][1] - 1]) + 1
            positions[r, start:stop] = torch.arange(base, base + stop - start)
            parents[r, start:stop] = torch.arange(start - 1, stop - 1)
            parents[r, start] = -1 if parent < 0 else segments[parent][1] - 1
    model = init_weights(Qwen3ForCausalLM(ARGS), seed=0, std=0.1)
    monkeypatch.setattr(tree_attention, "BLOCK_QUERIES", 16)
    planned = []
    for mask in (layout, layout.dense()):  # planned from the segments / from the dense mask
        logprobs = model_logprobs(model, MicroBatch(ids, positions, parents, mask))
        planned.append((logprobs.detach(), grads_of(model, logprobs)))
    (tree_lp, tree_grads), (dense_lp, dense_grads) = planned
    assert (tree_lp - dense_lp).abs().max() <= 1e-5
    for name, grad in dense_grads.items():
        assert (tree_grads[name] - grad).abs().max() <= 1e-5 * max(1.0, float(grad.abs().max())), name


def test_the_model_refuses_a_layout_that_does_not_fit_its_inputs():
    model = init_weights(Qwen3ForCausalLM(ARGS), seed=0)
    layout = TreeLayout(10, (((0, 10, -1),),))
    with pytest.raises(ValueError, match="tree layout of 1 rows x 10 columns does not fit input_ids"):
        model(torch.zeros(1, 12, dtype=torch.long), attention_mask=layout)


@pytest.mark.parametrize(
    ("width", "rows", "message"),
    [
        (
            10,
            (((0, 4, -1), (5, 8, 0)),),
            "segment 1 spans \\[5, 8\\); segments must be non-empty and consecutive",
        ),
        (10, (((0, 4, 1), (4, 8, -1)),), "segment 0 has parent 1; a parent must be an earlier segment"),
        (6, (((0, 4, -1), (4, 8, 0)),), "row 0 holds 8 columns, more than the width 6"),
        (10, (((0, 0, -1),),), "segment 0 spans \\[0, 0\\)"),
    ],
)
def test_a_bad_layout_is_refused_with_what_is_wrong(width, rows, message):
    with pytest.raises(ValueError, match=message):
        TreeLayout(width, rows)


def test_packed_micro_batches_carry_segments_whose_mask_is_the_ancestor_mask():
    workload = SyntheticWorkload(segments=(3, 3), turns=(4, 6), max_subagents=3)
    records, _ = synthetic_execution("long", 7, workload)
    sample = pack_paths("long", process_execution(records).selected)
    pieces = split_roots(sample)
    batches = micro_batches(pieces, row_tokens=1024, micro_batch_tokens=8192)
    assert sum(sum(b.meta["row_lengths"]) for b in batches) == sample.num_tokens
    for batch in batches:
        layout = batch.attention_mask
        assert isinstance(layout, TreeLayout) and (layout.batch, layout.width) == tuple(batch.input_ids.shape)
        dense = layout.dense()
        # column j sees exactly the chain of its predecessors (parent_index) up to the root
        for r in range(layout.batch):
            parents = batch.parent_index[r].tolist()
            for j in range(layout.real_length(r)):
                seen, col = [], j
                while col >= 0:
                    seen.append(col)
                    col = parents[col]
                assert dense[r, j].nonzero().squeeze(-1).tolist() == sorted(seen)
        # what goes through the object store is the segments: far below T^2 bytes
        assert len(pickle.dumps(batch)) < 200 * batch.input_ids.numel() + 20_000


def saved_bytes_for_backward(fn) -> int:
    """Bytes of the distinct storages autograd keeps for the backward pass while `fn` runs."""
    storages: dict[int, int] = {}

    def pack(t: torch.Tensor) -> torch.Tensor:
        storage = t.untyped_storage()
        storages[storage.data_ptr()] = storage.nbytes()
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        fn()
    return sum(storages.values())


def test_a_long_row_keeps_linear_memory_for_the_backward_pass(monkeypatch):
    segments = long_chain(random.Random(1), 6)  # ~9k tokens, two roots' worth of branches
    width = segments[-1][1]
    layout = TreeLayout(width, (segments,))
    g = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(1, h, width, 16, generator=g, requires_grad=True) for h in (4, 2, 2))
    inputs = sum(x.untyped_storage().nbytes() for x in (q, k, v))
    kept = {}
    for recompute_above in (1 << 40, 1 << 22):
        monkeypatch.setattr(tree_attention, "RECOMPUTE_ABOVE_MASK_BYTES", recompute_above)
        plan = plan_tree(layout, heads=4)
        kept[plan.recompute] = saved_bytes_for_backward(
            lambda p=plan: tree_attention.tree_attention(q, k, v, p)
        )
    assert width * width // 2 < kept[False]  # every block's mask (and gathered keys) would be kept
    assert kept[True] < 2 * inputs + width * 1024  # the inputs, the outputs and per-block scraps


@pytest.mark.parametrize("seed", range(6))
def test_query_ranges_of_a_plan_give_the_rows_of_the_whole(monkeypatch, seed):
    """A context-parallel rank plans only its columns' queries (one range or two) over all keys: the
    shares, put back at their columns, are the whole row's attention, whatever the range boundaries
    cut (blocks, segments, padding)."""
    rng = random.Random(100 + seed)
    monkeypatch.setattr(tree_attention, "BLOCK_QUERIES", rng.choice([5, 16, 128]))
    # odd seeds: masked blocks recomputed in the backward pass
    monkeypatch.setattr(tree_attention, "RECOMPUTE_ABOVE_MASK_BYTES", -1 if seed % 2 else 1 << 40)
    rows = tuple(random_row(rng, rng.randint(1, 12), rng.choice([3, 40])) for _ in range(rng.randint(1, 3)))
    width = max(row[-1][1] for row in rows) + rng.randint(0, 9)
    layout = TreeLayout(width, rows)
    g = torch.Generator().manual_seed(seed)
    q, k, v = (
        torch.randn(len(rows), h, width, 8, generator=g, dtype=torch.float64, requires_grad=True)
        for h in (4, 2, 2)
    )
    want = brute_force(q, k, v, layout.dense())
    cuts = sorted({0, width, *(rng.randint(0, width) for _ in range(rng.randint(1, 4)))})
    spans = list(zip(cuts, cuts[1:], strict=False))
    # each rank takes a span from each end, as the zigzag split does (the last may take one)
    shares = [tuple(sorted({spans[i], spans[-1 - i]})) for i in range((len(spans) + 1) // 2)]
    got = torch.zeros_like(want)
    for share in shares:
        plan = plan_tree(layout, heads=4, queries=share)
        columns = torch.cat([torch.arange(lo, hi) for lo, hi in share])
        assert (plan.q_ranges, plan.q_len, plan.keys_expected) == (share, columns.numel(), width)
        assert plan.recompute == bool(seed % 2 and columns.numel())
        got = got.index_add(2, columns, tree_attention.tree_attention(q[:, :, columns], k, v, plan))
    assert (got - want).abs().max() <= 1e-10
    assert_same_gradients(got, want, (q, k, v), g)
    with pytest.raises(ValueError, match="inside the rows"):
        plan_tree(layout, heads=4, queries=((0, width + 1),))
    with pytest.raises(ValueError, match="ascending, disjoint"):
        plan_tree(layout, heads=4, queries=((0, 2), (1, 3)))
