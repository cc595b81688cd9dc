"""Packing: each token laid out once, depth positions, ancestor-only attention, loss on generated tokens
only, per-execution weights; rows and micro-batches; the records -> micro-batches pipeline."""

from __future__ import annotations

import pytest
import torch

from gyre_ray.algo.gspo import step_scale
from gyre_ray.model.tree_layout import TreeLayout
from gyre_ray.trainers.batch import dense_attention_mask
from gyre_ray.trajectory.batching import collate, micro_batches, pack_rows
from gyre_ray.trajectory.config import TrajectorySection
from gyre_ray.trajectory.packing import Sample, expand_paths, pack_paths
from gyre_ray.trajectory.pieces import split_long, split_roots
from gyre_ray.trajectory.pipeline import build_training_batches, process_execution
from gyre_ray.trajectory.records import CallRecord
from gyre_ray.trajectory.synthetic import SyntheticWorkload, synthetic_execution

SMALL = SyntheticWorkload(system_tokens=20, task_tokens=6, subagent_system_tokens=10, tool_tokens=(3, 8),
                          output_tokens=(2, 6), summary_tokens=5, turns=(2, 4), max_subagents=4,
                          retry_prob=0.3)  # fmt: skip


def chain(parent_index: list[int], j: int) -> list[int]:
    """Columns from j up to its root, following parent_index."""
    out = []
    while j >= 0:
        out.append(j)
        j = parent_index[j]
    return out


@pytest.mark.parametrize("seed", range(6))
def test_packed_sample_lays_each_token_once_and_rebuilds_every_path(seed: int) -> None:
    records, _ = synthetic_execution("e", seed, SMALL)
    proc = process_execution(records, TrajectorySection(budget=4))
    sample = pack_paths("e", proc.selected)
    assert sample.num_tokens == proc.stats()["tokens_packed_selected"]
    generated = {
        tuple(r.input_ids + r.output_ids[: k + 1]) for r in records for k in range(len(r.output_ids))
    }
    for j in range(sample.num_tokens):
        cols = chain(sample.parent_index, j)[::-1]
        prefix = tuple(sample.input_ids[c] for c in cols)
        assert [sample.position_ids[c] for c in cols] == list(range(len(cols))), "position = depth"
        # Loss exactly on tokens some call generated in this very context (never prompt/tool tokens).
        assert sample.loss_mask[j] == (prefix in generated)
    for path, columns in zip(proc.selected, sample.path_columns, strict=True):
        tokens = [t for n in path.nodes for t in n.tokens]
        leaf_col = max(chain(sample.parent_index, columns[-1]))  # the path's last loss token
        walk = chain(sample.parent_index, leaf_col)[::-1]
        assert [sample.input_ids[c] for c in walk] == tokens[: len(walk)]
        assert columns == [c for c in walk if sample.loss_mask[c]]


@pytest.mark.parametrize("seed", range(4))
def test_weights_count_each_output_token_once_per_execution(seed: int) -> None:
    records, _ = synthetic_execution("e", seed, SMALL)
    proc = process_execution(records, TrajectorySection(budget=5))
    sample = pack_paths("e", proc.selected)
    per_column: dict[int, float] = {}
    for cols, weights in zip(sample.path_columns, sample.path_weights, strict=True):
        for c, w in zip(cols, weights, strict=True):
            per_column[c] = per_column.get(c, 0.0) + w
    loss_cols = [j for j, flag in enumerate(sample.loss_mask) if flag]
    assert sorted(per_column) == loss_cols
    assert all(w == pytest.approx(1.0 / len(loss_cols)) for w in per_column.values())
    assert sum(per_column.values()) == pytest.approx(1.0)
    # The expanded layout repeats shared tokens but carries the same weights, token for token.
    rows = expand_paths("e", proc.selected)
    assert sum(r.num_tokens for r in rows) == proc.stats()["tokens_expanded_selected"]
    assert sum(sum(r.path_weights[0]) for r in rows) == pytest.approx(1.0)
    for row, cols in zip(rows, sample.path_columns, strict=True):
        assert [row.input_ids[c] for c in row.path_columns[0]] == [sample.input_ids[c] for c in cols]


def test_attention_mask_is_exactly_ancestors_and_samples_in_a_row_are_isolated() -> None:
    samples = []
    for seed in range(3):
        records, _ = synthetic_execution(f"e{seed}", seed, SMALL)
        samples.append(pack_paths(f"e{seed}", process_execution(records).selected))
    pieces = [p for s in samples for p in split_roots(s)]
    assert sum(p.num_tokens for p in pieces) == sum(s.num_tokens for s in samples)
    assert sum(sum(map(sum, p.path_weights)) for p in pieces) == pytest.approx(3.0)
    width = sum(p.num_tokens for p in pieces)  # the longer row; the second row gets padding
    rows = [pieces, [samples[0]]]
    batch = collate(rows)
    layout = batch.attention_mask  # segments, never a dense (B, T, T) tensor
    assert isinstance(layout, TreeLayout) and (layout.batch, layout.width) == (2, width)
    assert batch.num_executions == 3
    dense = dense_attention_mask(batch)
    for r, row in enumerate(rows):
        parent = batch.parent_index[r].tolist()
        used = sum(s.num_tokens for s in row)
        expected = torch.zeros(width, width, dtype=torch.bool)
        for j in range(used):
            expected[j, chain(parent, j)] = True
        for j in range(used, width):
            expected[j, j] = True  # padding sees only itself (no all-False rows)
        assert torch.equal(dense[r], expected)
    assert batch.tensors["path_weights"][0].sum().item() == pytest.approx(3.0, rel=1e-6)
    assert batch.tensors["path_mask"].sum().item() == sum(
        len(c) for s in (*pieces, samples[0]) for c in s.path_columns
    )


def test_rows_and_micro_batches_respect_their_token_limits() -> None:
    samples = []
    for seed in range(8):
        records, _ = synthetic_execution(f"e{seed}", seed, SMALL)
        samples.extend(split_roots(pack_paths(f"e{seed}", process_execution(records).selected)))
    row_tokens = 160
    rows = pack_rows(samples, row_tokens)
    assert sorted(id(s) for row in rows for s in row) == sorted(id(s) for s in samples)
    for row in rows:
        assert sum(s.num_tokens for s in row) <= row_tokens or len(row) == 1
    batches = micro_batches(samples, row_tokens, 400)
    assert sum(b.meta["tokens"] for b in batches) == sum(s.num_tokens for s in samples)
    for b in batches:
        assert b.meta["padded_tokens"] <= 400 or b.input_ids.shape[0] == 1
    assert step_scale(batches) == pytest.approx(1 / 8)
    # Rows share a micro-batch only when padding stays within max_row_padding of the longest row.
    for b in micro_batches(samples, row_tokens, 4000, max_row_padding=0.1):
        lengths = b.meta["row_lengths"]
        assert max(lengths) == b.input_ids.shape[1] and min(lengths) >= 0.9 * max(lengths)
    with pytest.raises(ValueError, match="max_row_padding must be in \\[0, 1\\]"):
        micro_batches(samples, row_tokens, 400, max_row_padding=1.5)
    with pytest.raises(ValueError, match="micro_batch_tokens \\(100\\) must be >= row_tokens \\(160\\)"):
        micro_batches(samples, row_tokens, 100)


def test_build_training_batches_uses_group_normalised_advantages() -> None:
    executions = {f"e{i}": synthetic_execution(f"e{i}", i, SMALL)[0] for i in range(5)}
    rewards = {"e0": 1.0, "e1": 0.0, "e2": 0.5, "e3": 2.0, "e4": 2.0}
    groups = {"e0": "a", "e1": "a", "e2": "a", "e3": "b", "e4": "b"}
    batches = build_training_batches(
        executions, rewards, groups, TrajectorySection(row_tokens=64, micro_batch_tokens=64)
    )
    assert step_scale(batches) == pytest.approx(1 / 5)  # e2, e3, e4 count in the mean, untrained
    assert batches[0].meta["untrained_execution_ids"] == ["e2", "e3", "e4"]  # advantage 0
    std = (((1 - 0.5) ** 2 + (0 - 0.5) ** 2 + 0) / 3) ** 0.5  # population std of group a
    expected = {"e0": 0.5 / std, "e1": -0.5 / std}
    paths_seen = 0
    for b in batches:
        live = b.tensors["path_mask"].any(-1)
        for adv, owner in zip(
            b.tensors["path_advantages"][live], b.tensors["path_execution"][live], strict=True
        ):
            assert adv.item() == pytest.approx(expected[b.meta["execution_ids"][owner]], rel=1e-5, abs=1e-7)
            paths_seen += 1
    assert paths_seen == sum(len(process_execution(executions[e]).selected) for e in expected)


def test_build_training_batches_rejects_missing_rewards_and_skips_empty_executions() -> None:
    records, _ = synthetic_execution("e0", 0, SMALL)
    silent = [CallRecord("quiet", "c0", "main", [1, 2], [], [], [], 0.0, 1.0)]
    with pytest.raises(KeyError, match="executions without a reward: quiet"):
        build_training_batches({"e0": records, "quiet": silent}, {"e0": 1.0}, {"e0": "g"})
    batches = build_training_batches(
        {"e0": records, "quiet": silent}, {"e0": 1.0, "quiet": 0.0}, {"e0": "g", "quiet": "g"}
    )
    assert {e for b in batches for e in b.meta["execution_ids"]} == {"e0"}
    with pytest.raises(ValueError, match="is listed under 'other'"):
        build_training_batches({"other": records}, {"other": 1.0}, {"other": "g"})


def test_per_path_weights_leave_out_a_path_without_loss_tokens() -> None:
    """Two paths, one of them a main call cut off before it generated a token: with `per_path`
    weights the other path carries the whole execution (this used to divide by zero)."""
    prompt = [1, 2, 3]
    records = [
        CallRecord("e", "m1", "main", prompt, [4, 5], [-1.0, -1.0], [0, 0], 0.0, 1.0),
        CallRecord("e", "m2", "main", [*prompt, 9], [], [], [], 2.0, 3.0),
    ]
    proc = process_execution(records)
    sample = pack_paths("e", proc.paths, weights="per_path")
    weights = [w for ws in sample.path_weights for w in ws]
    assert sorted(len(cols) for cols in sample.path_columns) == [0, 2]
    assert weights == [pytest.approx(0.5), pytest.approx(0.5)]


def _branching_sample(prefix_loss: bool) -> Sample:
    """A 4-token root (its last token a model output when `prefix_loss`) and two branches under it,
    of 5 and 6 tokens whose last 2 are model outputs; one path per branch."""
    loss = [False, False, False, prefix_loss, False, False, False, True, True] + [False] * 4 + [True] * 2
    paths = [[c for c in (3, 7, 8) if loss[c]], [c for c in (3, 13, 14) if loss[c]]]
    total = sum(loss)
    return Sample(
        execution_id="e", input_ids=list(range(100, 115)), position_ids=[*range(9), *range(4, 10)],
        parent_index=[-1, 0, 1, 2, 3, 4, 5, 6, 7, 3, 9, 10, 11, 12, 13],
        segments=[(0, 4, -1), (4, 9, 0), (9, 15, 0)], loss_mask=loss,
        old_logprobs=[-0.5 if f else 0.0 for f in loss], versions=[3 if f else -1 for f in loss],
        path_columns=paths, path_weights=[[1 / ((1 + (c == 3)) * total) for c in cols] for cols in paths],
        path_roles=["main", "sub-agent"], advantage=0.5,
    )  # fmt: skip


def test_a_long_tree_is_cut_below_a_loss_free_prefix_each_piece_with_its_copy() -> None:
    """Over `max_tokens`, the tree is cut at its topmost branch point: one piece per branch, each
    with a copy of the root as its ancestry; every path whole in one piece, its loss tokens once."""
    sample = _branching_sample(prefix_loss=False)
    assert split_long(sample, 0) == [sample] and split_long(sample, 15) == [sample]  # fits: whole
    first, second = split_long(sample, 10)
    assert first.input_ids == [*range(100, 104), *range(104, 109)]
    assert second.input_ids == [*range(100, 104), *range(109, 115)]
    assert second.parent_index == [-1, 0, 1, 2, 3, 4, 5, 6, 7, 8]  # the copy is the branch's ancestry
    assert second.position_ids == [0, 1, 2, 3, 4, 5, 6, 7, 8, 9]
    assert second.segments == [(0, 4, -1), (4, 10, 0)]
    assert (first.path_columns, second.path_columns) == ([[7, 8]], [[8, 9]])
    assert [second.input_ids[c] for c in second.path_columns[0]] == [113, 114]
    assert first.path_weights + second.path_weights == sample.path_weights
    assert sum(first.loss_mask) + sum(second.loss_mask) == sum(sample.loss_mask)
    assert (first.path_roles, second.path_roles) == (["main"], ["sub-agent"])
    assert second.meta == {"piece": 1, "prefix_tokens": 4}


def test_a_prefix_holding_a_loss_token_is_never_copied() -> None:
    """Copying it would score that model output twice: such a tree stays whole, however long."""
    sample = _branching_sample(prefix_loss=True)
    assert split_long(sample, 5) == [sample]
    with pytest.raises(ValueError, match="max_tokens must be >= 0"):
        split_long(sample, -1)


def test_cut_pieces_of_real_trees_keep_every_path_and_loss_token_once() -> None:
    """Synthetic agent trees (sub-agents, compactions, retries) cut to pieces of at most 40 tokens
    where a loss-free prefix allows: the same loss tokens and paths, every piece's attention exact."""
    for seed in range(4):
        records, _ = synthetic_execution(f"e{seed}", seed, SMALL)
        sample = pack_paths(f"e{seed}", process_execution(records).selected)
        pieces = split_long(sample, 40)
        assert len(pieces) > len(split_roots(sample))
        assert sum(p.num_loss_tokens for p in pieces) == sample.num_loss_tokens
        assert sorted(w for p in pieces for ws in p.path_weights for w in ws) == sorted(
            w for ws in sample.path_weights for w in ws
        )

        def path_chains(samples: list[Sample]) -> list[list[int]]:  # each path's tokens, leaf to root
            return sorted(
                [s.input_ids[c] for c in chain(s.parent_index, cols[-1])]
                for s in samples for cols in s.path_columns if cols
            )  # fmt: skip

        assert path_chains(pieces) == path_chains([sample])
        for piece in pieces:  # depth positions follow each column's ancestry
            for j in range(piece.num_tokens):
                assert len(chain(piece.parent_index, j)) == piece.position_ids[j] + 1
