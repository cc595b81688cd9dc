"""KV cache, padded batches, packed and tree attention masks give the same logits as plain runs."""

from __future__ import annotations

import pytest
import torch

from gyre_ray.model import attention
from gyre_ray.model.arch import ModelArgs
from gyre_ray.model.kv_cache import KVCache
from gyre_ray.model.qwen3 import Qwen3ForCausalLM, init_weights
from gyre_ray.trainers.batch import token_logprobs

TOL = 1e-5


@pytest.fixture(scope="module")
def model() -> Qwen3ForCausalLM:
    args = ModelArgs(
        vocab_size=256,
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=3,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=16,
        max_position_embeddings=1024,
    )
    # A wide init makes attention sharp, so a wrong mask or position changes the logits visibly.
    return init_weights(Qwen3ForCausalLM(args), seed=0, std=0.2).eval()


def ids(length: int, seed: int) -> torch.Tensor:
    return torch.randint(0, 256, (1, length), generator=torch.Generator().manual_seed(seed))


def causal(length: int) -> torch.Tensor:
    return torch.ones(length, length, dtype=torch.bool).tril()


def max_diff(a: torch.Tensor, b: torch.Tensor) -> float:
    return (a - b).abs().max().item()


@torch.no_grad()
def test_prefill_then_decode_equals_full_forward(model):
    tokens = ids(40, seed=1)
    full = model(tokens)
    cache = KVCache()
    steps = [model(tokens[:, :13], kv_cache=cache)]
    steps.append(model(tokens[:, 13:21], kv_cache=cache))  # multi-token append after a prefix
    steps += [model(tokens[:, t : t + 1], kv_cache=cache) for t in range(21, 40)]
    assert cache.length == 40
    assert max_diff(torch.cat(steps, 1), full) <= TOL


@torch.no_grad()
def test_chunked_attention_equals_single_chunk(model, monkeypatch):
    tokens = ids(30, seed=2)
    mask = causal(30).unsqueeze(0)
    reference = model(tokens, attention_mask=mask)
    cache = KVCache()
    model(tokens[:, :10], kv_cache=cache)
    reference_append = model(tokens[:, 10:], kv_cache=cache)
    monkeypatch.setattr(attention, "MAX_SCORES_PER_CHUNK", 4 * 30 * 3)  # 3 query rows per chunk
    assert max_diff(model(tokens, attention_mask=mask), reference) <= TOL
    cache = KVCache()
    model(tokens[:, :10], kv_cache=cache)
    assert max_diff(model(tokens[:, 10:], kv_cache=cache), reference_append) <= TOL


@torch.no_grad()
def test_padded_batch_with_masks_and_positions_equals_each_row_alone(model):
    lengths, new_tokens = [5, 9, 7], 4
    rows = [ids(n + new_tokens, seed=10 + i) for i, n in enumerate(lengths)]
    width = max(lengths)
    batch = torch.zeros(len(rows), width, dtype=torch.long)
    valid = torch.zeros(len(rows), width, dtype=torch.bool)
    for b, n in enumerate(lengths):
        batch[b, :n], valid[b, :n] = rows[b][0, :n], True
    positions = torch.arange(width).expand(len(rows), width)
    mask = causal(width).unsqueeze(0) & valid.unsqueeze(1)  # pads attend to nothing
    cache = KVCache()
    logits = model(batch, positions, mask, kv_cache=cache)
    assert torch.isfinite(logits).all()
    alone = [model(row) for row in rows]
    for b, n in enumerate(lengths):
        assert max_diff(logits[b, :n], alone[b][0, :n]) <= TOL
    # Decode one token per row into the shared, right-padded cache.
    for step in range(new_tokens):
        step_ids = torch.stack([rows[b][0, n + step] for b, n in enumerate(lengths)]).unsqueeze(1)
        step_pos = torch.tensor(lengths).unsqueeze(1) + step
        valid = torch.cat([valid, torch.ones(len(rows), 1, dtype=torch.bool)], 1)
        out = model(step_ids, step_pos, valid.unsqueeze(1), kv_cache=cache)
        for b, n in enumerate(lengths):
            assert max_diff(out[b, 0], alone[b][0, n + step]) <= TOL


@torch.no_grad()
def test_packed_rows_with_block_mask_equal_each_sequence_alone(model):
    first, second = ids(11, seed=20), ids(8, seed=21)
    packed = torch.cat([first, second], 1)
    mask = torch.block_diag(causal(11), causal(8)).unsqueeze(0)
    positions = torch.cat([torch.arange(11), torch.arange(8)]).unsqueeze(0)
    parents = torch.cat([torch.arange(11) - 1, torch.arange(8) - 1 + 11]).unsqueeze(0)
    parents[0, 11] = -1  # the second sequence's first token has no predecessor
    logits = model(packed, positions, mask)
    alone = torch.cat([model(first), model(second)], 1)
    assert max_diff(logits, alone) <= TOL
    logprobs = token_logprobs(logits, packed, parents)
    expected = torch.cat(
        [
            token_logprobs(model(first), first, torch.arange(11).unsqueeze(0) - 1),
            token_logprobs(model(second), second, torch.arange(8).unsqueeze(0) - 1),
        ],
        1,
    )
    assert max_diff(logprobs, expected) <= TOL


@torch.no_grad()
def test_tree_mask_shares_prefix_between_branches(model):
    prefix, branch_a, branch_b = ids(6, seed=30), ids(4, seed=31), ids(3, seed=32)
    row = torch.cat([prefix, branch_a, branch_b], 1)
    n = row.size(1)
    ancestor = torch.zeros(n, n, dtype=torch.bool)
    ancestor[:, :6] = True
    ancestor[6:10, 6:10] = causal(4)
    ancestor[10:, 10:] = causal(3)
    mask = (ancestor & causal(n)).unsqueeze(0)
    positions = torch.cat([torch.arange(6), 6 + torch.arange(4), 6 + torch.arange(3)]).unsqueeze(0)
    logits = model(row, positions, mask)
    path_a = model(torch.cat([prefix, branch_a], 1))
    path_b = model(torch.cat([prefix, branch_b], 1))
    assert max_diff(logits[:, :10], path_a) <= TOL
    assert max_diff(logits[:, 10:], path_b[:, 6:]) <= TOL


def test_rows_with_nothing_to_attend_to_are_finite_and_do_not_disturb_others(model):
    tokens = torch.cat([ids(6, seed=40), ids(6, seed=41)], 0)
    mask = causal(6).expand(2, 6, 6).clone()
    mask[1] = False  # a whole padding row
    mask[0, 4] = False  # a pad in the middle of a real row: its query sees nothing ...
    mask[0, :, 4] = False  # ... and no other query sees it
    logits = model(tokens, attention_mask=mask)
    assert torch.isfinite(logits).all()
    logits.sum().backward()
    assert all(torch.isfinite(p.grad).all() for p in model.parameters() if p.grad is not None)
    model.zero_grad(set_to_none=True)
    with torch.no_grad():
        keep = torch.tensor([[0, 1, 2, 3, 5]])
        alone = model(tokens[:1, keep[0]], position_ids=keep)
        assert max_diff(logits[0, keep[0]].detach(), alone[0]) <= TOL


@torch.no_grad()
def test_stack_split_state_and_truncate_round_trip(model):
    rows = [ids(n, seed=50 + n) for n in (4, 9)]
    caches = []
    for row in rows:
        caches.append(KVCache())
        model(row, kv_cache=caches[-1])
    stacked = KVCache.stack(caches, pad_to=12)
    assert (stacked.batch_size, stacked.length) == (2, 12)
    valid = torch.zeros(2, 12, dtype=torch.bool)
    valid[0, :4], valid[1, :9] = True, True
    for original, back in zip(caches, stacked.split(valid), strict=True):
        assert back.length == original.length
        for layer in range(original.num_layers):
            assert torch.equal(back.keys(layer), original.keys(layer))
            assert torch.equal(back.values(layer), original.values(layer))
    picked = stacked.select_rows([1])
    assert picked.batch_size == 1 and torch.equal(picked.keys(0)[:, :, :9], caches[1].keys(0))
    # A cache moved through to_state/from_state continues exactly like the original.
    moved = KVCache.from_state(caches[1].to_state())
    assert moved.nbytes == caches[1].nbytes == 3 * 2 * 2 * 9 * 16 * 4
    nxt = ids(1, seed=99)
    assert torch.equal(model(nxt, kv_cache=moved), model(nxt, kv_cache=caches[1]))
    # Truncating back to a prefix and re-feeding the rest reproduces a full forward.
    full = model(rows[1])
    cache = KVCache()
    model(rows[1], kv_cache=cache)
    cache.truncate(5)
    assert max_diff(model(rows[1][:, 5:], kv_cache=cache), full[:, 5:]) <= TOL


def test_cache_errors_name_the_problem(model):
    cache = KVCache()
    with torch.no_grad():
        model(ids(5, seed=1), kv_cache=cache)
    with pytest.raises(ValueError, match="pad_to=3"):
        KVCache.stack([cache], pad_to=3)
    with pytest.raises(ValueError, match="truncate"):
        cache.truncate(6)
    with pytest.raises(ValueError, match="keys"):
        KVCache.from_state({"k.0": torch.zeros(1, 2, 3, 16)})
    with pytest.raises(ValueError, match="attention_mask shape"):
        model(ids(2, seed=1), attention_mask=causal(2).unsqueeze(0), kv_cache=cache)
    with pytest.raises(ValueError, match="holds 1 rows"):
        model(torch.zeros(2, 1, dtype=torch.long), kv_cache=cache)
    assert cache.length == 5  # failed calls left the cache untouched


@torch.no_grad()
def test_unmasked_prefill_never_builds_a_token_by_token_mask(model, monkeypatch):
    calls = []
    real_sdpa = torch.nn.functional.scaled_dot_product_attention

    def spy(q, k, v, attn_mask=None, is_causal=False, **kwargs):
        calls.append((attn_mask, is_causal, q.size(2), k.size(2)))
        return real_sdpa(q, k, v, attn_mask=attn_mask, is_causal=is_causal, **kwargs)

    monkeypatch.setattr(torch.nn.functional, "scaled_dot_product_attention", spy)
    cache = KVCache()
    model(ids(64, seed=3), kv_cache=cache)  # fresh prefill: the fused causal kernel, no mask
    assert calls and all(mask is None and causal for mask, causal, _, _ in calls)
    calls.clear()
    monkeypatch.setattr(attention, "MAX_SCORES_PER_CHUNK", 4 * 80 * 4)  # 4 query rows per chunk
    model(ids(16, seed=4), kv_cache=cache)  # append after a past: bounded per-chunk masks
    assert all(mask.numel() <= 4 * 80 for mask, _, _, _ in calls)
    assert sum(t for _, _, t, _ in calls) == 16 * model.args.num_hidden_layers


@torch.no_grad()
def test_empty_caches_count_as_rows_of_padding_when_stacked(model):
    filled = KVCache()
    model(ids(3, seed=7), kv_cache=filled)
    two_empty = KVCache.stack([KVCache(), KVCache()])
    assert (two_empty.batch_size, two_empty.num_layers) == (2, 0)
    batch = KVCache.stack([two_empty, filled])
    assert (batch.batch_size, batch.length) == (3, 3)
    assert torch.count_nonzero(batch.keys(0)[:2]) == 0
    assert [c.length for c in batch.split(torch.tensor([[False] * 3, [False] * 3, [True] * 3]))] == [0, 0, 3]
    assert KVCache.from_state(KVCache().to_state()).length == 0
    assert KVCache().select_rows([0, 0]).batch_size == 2
