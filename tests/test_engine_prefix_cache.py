"""The radix prefix cache: longest-prefix matches return the stored KV exactly, edges split where
sequences diverge, the token budget holds with least-recently-used leaves evicted first."""

from __future__ import annotations

import torch

from gyre_ray.engines.prefix_cache import PrefixCache
from gyre_ray.model.kv_cache import KVCache

LAYERS, HEADS, DIM = 2, 2, 4


def kv_for(tokens: list[int]) -> KVCache:
    """A cache whose KV at each position encodes (layer, kind, token, position), so matches are checkable."""
    state = {}
    for layer in range(LAYERS):
        for kind, sign in (("k", 1.0), ("v", -1.0)):
            t = torch.tensor(tokens, dtype=torch.float32)
            pos = torch.arange(len(tokens), dtype=torch.float32)
            cols = sign * (1000 * layer + t * 10 + pos / 1000)
            state[f"{kind}.{layer}"] = cols.view(1, 1, -1, 1).expand(1, HEADS, -1, DIM).contiguous()
    return KVCache.from_state(state)


def assert_is_kv_of(cache: KVCache, tokens: list[int]) -> None:
    expected = kv_for(tokens)
    assert cache.length == len(tokens)
    for layer in range(LAYERS):
        assert torch.equal(cache.keys(layer), expected.keys(layer))
        assert torch.equal(cache.values(layer), expected.values(layer))


def test_match_returns_the_longest_stored_prefix_with_its_kv() -> None:
    cache = PrefixCache(1000)
    a = [1, 2, 3, 4, 5, 6]
    assert cache.insert(a, kv_for(a)) == 6
    n, kv = cache.match([1, 2, 3, 9, 9])
    assert n == 3
    assert_is_kv_of(kv, [1, 2, 3])
    n, kv = cache.match(a + [7, 8])
    assert n == 6
    assert_is_kv_of(kv, a)
    assert cache.match([2, 3]) == (0, None)
    n, _ = cache.match(a, limit=4)
    assert n == 4


def test_diverging_sequences_share_their_common_edge() -> None:
    cache = PrefixCache(1000)
    a, b = [1, 2, 3, 4, 5], [1, 2, 3, 7, 8, 9]
    cache.insert(a, kv_for(a))
    assert cache.insert(b, kv_for(b)) == 3  # only the new suffix is stored
    assert cache.stored_tokens == 8
    for seq in (a, b):
        n, kv = cache.match(seq)
        assert n == len(seq)
        assert_is_kv_of(kv, seq)
    longer = b + [10, 11]
    assert cache.insert(longer, kv_for(longer)) == 2
    n, kv = cache.match(longer)
    assert_is_kv_of(kv, longer)


def test_budget_evicts_least_recently_used_leaves_first() -> None:
    cache = PrefixCache(12)
    old, recent = [1, 2, 3, 4, 5], [9, 8, 7, 6, 5]
    cache.insert(old, kv_for(old))
    cache.insert(recent, kv_for(recent))
    cache.match(old)  # touch: `recent` is now the least recently used
    newest = [4, 4, 4, 4]
    cache.insert(newest, kv_for(newest))
    assert cache.stored_tokens <= 12
    assert cache.match(recent) == (0, None)
    assert cache.match(old)[0] == 5 and cache.match(newest)[0] == 4
    assert cache.evicted_tokens == 5


def test_childless_parents_become_evictable_and_zero_budget_disables() -> None:
    cache = PrefixCache(6)
    a, b = [1, 2, 3, 4], [1, 2, 5, 6]
    cache.insert(a, kv_for(a))
    cache.insert(b, kv_for(b))  # tree: [1,2] -> {[3,4], [5,6]}; 6 tokens
    c = [7, 7, 7, 7, 7, 7]
    cache.insert(c, kv_for(c))
    assert cache.stored_tokens == 6 and cache.match(c)[0] == 6
    assert cache.match([1, 2]) == (0, None)
    off = PrefixCache(0)
    assert off.insert(a, kv_for(a)) == 0 and off.match(a) == (0, None)


def test_clear_drops_everything() -> None:
    cache = PrefixCache(100)
    cache.insert([1, 2, 3], kv_for([1, 2, 3]))
    cache.clear()
    assert cache.stored_tokens == 0 and cache.match([1, 2, 3]) == (0, None)


def test_a_hit_is_copied_once_into_a_buffer_sized_for_the_prompt() -> None:
    cache = PrefixCache(1000)
    a, b = [1, 2, 3, 4], [1, 2, 3, 9, 8]
    cache.insert(a, kv_for(a))
    cache.insert(b, kv_for(b))  # the tree now holds [1, 2, 3] -> {[4], [9, 8]}: a hit spans two edges
    n, kv = cache.match(b + [7], capacity=20)
    assert n == 5 and kv.capacity == 20
    assert_is_kv_of(kv, b)
    before = kv._k[0].data_ptr()
    kv.update(0, torch.zeros(1, HEADS, 3, DIM), torch.zeros(1, HEADS, 3, DIM))
    assert kv._k[0].data_ptr() == before  # the prompt's remaining tokens append without regrowing


def test_an_owned_cache_becomes_a_new_root_edge_without_a_copy() -> None:
    cache = PrefixCache(1000)
    a = [5, 6, 7]
    handed_over, kept = kv_for(a), kv_for(a)
    cache.insert(a, handed_over, owned=True)
    other = PrefixCache(1000)
    other.insert(a, kept)
    shared = cache._root.children[5].k[0]
    assert shared.data_ptr() == handed_over.keys(0)[0].data_ptr()
    assert other._root.children[5].k[0].data_ptr() != kept.keys(0)[0].data_ptr()
    assert_is_kv_of(cache.match(a)[1], a)
