"""A radix tree of token prefixes holding their KV, bounded by a token budget with LRU eviction.

A later turn of an agent session re-sends its earlier prompt plus the model's own output and a new
message; the engine looks the prompt up here and prefills only what follows the longest cached
prefix (its KV copied once into the request's cache). Each edge of the tree stores the keys/values of its tokens (per layer, `(n_kv, n, head_dim)`
CPU/engine-device tensors), so a match is the concatenation of the KV along one root path. Eviction
removes least-recently-used leaves until the stored tokens fit the budget; parents left childless
become leaves in turn. Cached KV belongs to one set of weights: the engine clears the tree when the
weights change.
"""

from __future__ import annotations

import heapq
import itertools
from collections.abc import Sequence

import torch

from gyre_ray.model.kv_cache import KVCache


class _Node:
    __slots__ = ("children", "k", "last_used", "parent", "tokens", "v")

    def __init__(
        self,
        tokens: tuple[int, ...],
        k: list[torch.Tensor],
        v: list[torch.Tensor],
        parent: _Node | None,
        tick: int,
    ) -> None:
        self.tokens = tokens  # the edge label: tokens this node adds after its parent's path
        self.k = k  # per layer (n_kv, len(tokens), head_dim)
        self.v = v
        self.parent = parent
        self.children: dict[int, _Node] = {}
        self.last_used = tick

    def split(self, at: int) -> _Node:
        """Cut this node's edge after `at` tokens; return the new upper node (which becomes our parent)."""
        upper = _Node(
            self.tokens[:at],
            [k[:, :at].clone() for k in self.k],
            [v[:, :at].clone() for v in self.v],
            self.parent,
            self.last_used,
        )
        assert self.parent is not None
        self.parent.children[self.tokens[0]] = upper
        self.tokens = self.tokens[at:]
        self.k = [k[:, at:].clone() for k in self.k]
        self.v = [v[:, at:].clone() for v in self.v]
        self.parent = upper
        upper.children[self.tokens[0]] = self
        return upper


def _common_length(a: Sequence[int], b: Sequence[int]) -> int:
    n = 0
    for x, y in zip(a, b, strict=False):
        if x != y:
            break
        n += 1
    return n


def _edge(buf: torch.Tensor, row: int, start: int, stop: int, share: bool) -> torch.Tensor:
    """Positions [start, stop) of row `row` of a (B, H, S, D) buffer: a view when shared, else a copy."""
    part = buf[row, :, start:stop]
    return part if share else part.clone()


class PrefixCache:
    """Token-prefix -> KV store with a token budget (0 disables caching)."""

    def __init__(self, budget_tokens: int) -> None:
        if budget_tokens < 0:
            raise ValueError(f"prefix cache budget must be >= 0 tokens, got {budget_tokens}")
        self.budget_tokens = budget_tokens
        self._clock = itertools.count(1)
        self._root = _Node((), [], [], None, 0)
        self.stored_tokens = 0
        self.evicted_tokens = 0
        self.nodes = 0

    def clear(self) -> None:
        """Drop everything (the weights changed, or memory is being released)."""
        self._root = _Node((), [], [], None, 0)
        self.stored_tokens = 0
        self.nodes = 0

    def match(
        self, tokens: Sequence[int], limit: int | None = None, capacity: int = 0
    ) -> tuple[int, KVCache | None]:
        """Longest cached prefix of `tokens[:limit]`: (its length, a fresh single-row KVCache) or (0, None).

        The matched KV is copied once, straight into the new cache's buffers, sized for at least
        `capacity` positions (the request's prompt), so its prefill appends without regrowing.
        """
        tokens = tokens if limit is None else tokens[:limit]
        if not self.budget_tokens or not tokens:
            return 0, None
        tick = next(self._clock)
        node, pos = self._root, 0
        pieces: list[tuple[_Node, int]] = []  # (node, tokens of its edge used)
        while pos < len(tokens):
            child = node.children.get(tokens[pos])
            if child is None:
                break
            n = _common_length(child.tokens, tokens[pos:])
            child.last_used = tick
            pieces.append((child, n))
            pos += n
            if n < len(child.tokens):
                break
            node = child
        if pos == 0:
            return 0, None
        ks, vs = [], []
        for layer in range(len(pieces[0][0].k)):
            ref = pieces[0][0].k[layer]
            for bufs, side in ((ks, "k"), (vs, "v")):
                buf = ref.new_empty((1, ref.size(0), max(pos, capacity), ref.size(2)))
                at = 0
                for piece, n in pieces:
                    buf[0, :, at : at + n] = getattr(piece, side)[layer][:, :n]
                    at += n
                bufs.append(buf)
        return pos, KVCache.from_buffers(ks, vs, pos)

    def insert(self, tokens: Sequence[int], cache: KVCache, row: int = 0, owned: bool = False) -> int:
        """Store the KV of `tokens` (row `row` of `cache` covers them from position 0); return tokens added.

        `owned`: the caller hands `cache` over (it is not used afterwards), so a new root edge keeps
        views of its buffers instead of a copy.
        """
        if not self.budget_tokens or not tokens:
            return 0
        if cache.length < len(tokens):
            raise ValueError(f"PrefixCache.insert: cache holds {cache.length} positions, need {len(tokens)}")
        tokens = tuple(tokens[: self.budget_tokens])
        tick = next(self._clock)
        node, pos, added = self._root, 0, 0
        while pos < len(tokens):
            child = node.children.get(tokens[pos])
            if child is None:
                share = owned and pos == 0 and cache.batch_size == 1 and cache.length == len(tokens)
                leaf = _Node(
                    tokens[pos:],
                    [_edge(cache.keys(i), row, pos, len(tokens), share) for i in range(cache.num_layers)],
                    [_edge(cache.values(i), row, pos, len(tokens), share) for i in range(cache.num_layers)],
                    node,
                    tick,
                )
                node.children[tokens[pos]] = leaf
                self.nodes += 1
                added = len(tokens) - pos
                break
            n = _common_length(child.tokens, tokens[pos:])
            if n < len(child.tokens):
                child = child.split(n)
                self.nodes += 1
            child.last_used = tick
            node, pos = child, pos + n
        self.stored_tokens += added
        self._evict()
        return added

    def _evict(self) -> None:
        if self.stored_tokens <= self.budget_tokens:
            return
        leaves = [(n.last_used, id(n), n) for n in self._iter_nodes() if not n.children]
        heapq.heapify(leaves)
        while self.stored_tokens > self.budget_tokens and leaves:
            _, _, leaf = heapq.heappop(leaves)
            parent = leaf.parent
            assert parent is not None
            del parent.children[leaf.tokens[0]]
            self.stored_tokens -= len(leaf.tokens)
            self.evicted_tokens += len(leaf.tokens)
            self.nodes -= 1
            if parent is not self._root and not parent.children:
                heapq.heappush(leaves, (parent.last_used, id(parent), parent))

    def _iter_nodes(self):
        stack = list(self._root.children.values())
        while stack:
            node = stack.pop()
            yield node
            stack.extend(node.children.values())
