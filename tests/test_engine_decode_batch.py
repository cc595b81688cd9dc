"""The padded decode batch: rows of different lengths share one cache, the step mask and positions
follow each row's own columns, and removing rows (with compaction) keeps every row's KV intact."""

from __future__ import annotations

import torch

from gyre_ray.engines.base import SamplingParams
from gyre_ray.engines.decode_batch import DecodeBatch
from gyre_ray.engines.requests import ActiveRequest, EventSink
from gyre_ray.model.kv_cache import KVCache


def row(rid: str, prompt_len: int, outputs: int) -> tuple[ActiveRequest, KVCache]:
    req = ActiveRequest(
        rid=rid,
        input_ids=list(range(1, prompt_len + 1)),
        sampling=SamplingParams(),
        generator=torch.Generator(),
        seed=0,
        stop_ids=frozenset(),
        sink=EventSink.__new__(EventSink),
        output_ids=list(range(100, 100 + outputs)),
    )
    n = req.kv_target
    values = torch.arange(n, dtype=torch.float32) + 1000 * prompt_len  # unique per row and column
    state = {f"{kind}.0": values.view(1, 1, n, 1).expand(1, 2, n, 3).contiguous() for kind in "kv"}
    return req, KVCache.from_state(state)


def test_rows_keep_their_own_columns_through_joins_steps_and_removals() -> None:
    batch = DecodeBatch()
    rows = [row("a", 9, 1), row("b", 3, 2), row("c", 14, 1)]
    for req, cache in rows:
        batch.add(req, cache)
    assert batch.length == 14 and len(batch) == 3
    tokens, positions, mask = batch.step_inputs()
    assert tokens[:, 0].tolist() == [100, 101, 100]
    assert positions[:, 0].tolist() == [9, 4, 14]
    assert mask is not None and mask.shape == (3, 1, 15)
    assert mask[1, 0].tolist() == [True] * 4 + [False] * 10 + [True]
    for index, (_, cache) in enumerate(rows):
        assert torch.equal(batch.row_cache(index).keys(0), cache.keys(0))

    # simulate one decode step: every row writes one column at the end
    new = torch.full((3, 2, 1, 3), -1.0)
    batch.cache.update(0, new, new)
    batch.cache.advance(1)
    batch.after_step()
    b_after = batch.row_cache(1).keys(0)
    assert b_after.shape[2] == 5 and float(b_after[0, 0, -1, 0]) == -1.0

    batch.remove([2])  # the longest row leaves: padding now outweighs tokens, so the batch compacts
    assert len(batch) == 2 and batch.length == 10
    assert torch.equal(batch.row_cache(1).keys(0), b_after)
    assert batch.valid.sum(1).tolist() == [10, 5]
    batch.remove([0, 1])
    assert len(batch) == 0


def test_equal_rows_need_no_mask_and_joins_keep_rows_at_least_half_full() -> None:
    batch = DecodeBatch()
    for rid in "xy":
        batch.add(*row(rid, 6, 1))
    assert batch.step_inputs()[2] is None
    assert batch.join_cost(6, max_padding_ratio=0.0) == 0
    assert batch.join_cost(12, max_padding_ratio=1.0) == 3 * 12 - 24  # rows of 6 keep half the width
    assert batch.join_cost(13, max_padding_ratio=1.0) is None  # ... but not less
    assert batch.join_cost(3, max_padding_ratio=1.0) == 3 * 6 - 15
    assert batch.join_cost(2, max_padding_ratio=1.0) is None
