"""Several requests' prompts prefilled in one forward: one packed row, one KV cache per request.

The engine's batched prefill lays the new tokens of every waiting request side by side in a single
row (no padding) and passes a `PackedCaches` as the model's `kv_cache`: each layer's projections
run once over all of them (one pass over the weights), then the new keys/values of segment i go
into request i's own `KVCache` and segment i attends causally over that cache (its cached past +
its new tokens) and nothing else. Per segment that is the fused causal kernel (no past) or the
block plan of `gyre_ray.model.attention` (a past), never a mask over the whole row.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from gyre_ray.model.attention import AttentionPlan, attend, plan_causal
from gyre_ray.model.kv_cache import KVCache


class PackedCaches:
    """`caches[i]` receives the `lengths[i]` new tokens of segment i of a packed (1, sum(lengths)) row."""

    def __init__(
        self, caches: Sequence[KVCache], lengths: Sequence[int], device: torch.device, heads: int
    ) -> None:
        if len(caches) != len(lengths) or not caches or min(lengths) < 1:
            raise ValueError("PackedCaches needs one cache per segment and >= 1 new token per segment")
        if any(c.batch_size != 1 for c in caches):
            raise ValueError("PackedCaches: every segment's cache must hold a single row")
        self.caches = list(caches)
        self.lengths = list(lengths)
        self.bounds = [0]
        for n in lengths:
            self.bounds.append(self.bounds[-1] + n)
        self.pasts = [c.length for c in caches]
        self.plans: list[AttentionPlan | None] = [
            plan_causal(n, past, device, 1, heads) if past and n > 1 else None
            for n, past in zip(self.lengths, self.pasts, strict=True)
        ]
        self.length = 0  # the packed row itself has no shared past
        self.batch_size = 1
        self.num_layers = 0  # no shared buffers: the model's batch check does not apply
        self._keys: list[tuple[torch.Tensor, torch.Tensor]] = []

    @property
    def tokens(self) -> int:
        return self.bounds[-1]

    def last_columns(self) -> list[int]:
        """Column of each segment's last token in the packed row (where its next token is predicted)."""
        return [b - 1 for b in self.bounds[1:]]

    def update(self, layer: int, k: torch.Tensor, v: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Append each segment's new keys/values to its own cache (attention reads them via `attend`)."""
        self._keys = []
        for i, cache in enumerate(self.caches):
            a, b = self.bounds[i], self.bounds[i + 1]
            self._keys.append(cache.update(layer, k[:, :, a:b], v[:, :, a:b]))
        return k, v

    def attend(self, q: torch.Tensor) -> torch.Tensor:
        """Each segment's queries over its own cache (causal), concatenated back into the row."""
        outputs = []
        for i, (keys, values) in enumerate(self._keys):
            a, b = self.bounds[i], self.bounds[i + 1]
            outputs.append(attend(q[:, :, a:b], keys, values, self.plans[i], self.pasts[i]))
        self._keys = []
        return torch.cat(outputs, dim=2) if len(outputs) > 1 else outputs[0]

    def advance(self, n: int) -> None:
        if n != self.tokens:
            raise ValueError(f"PackedCaches.advance({n}) but the row holds {self.tokens} tokens")
        for cache, length in zip(self.caches, self.lengths, strict=True):
            cache.advance(length)
