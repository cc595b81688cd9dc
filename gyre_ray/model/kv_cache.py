"""Key/value cache of the policy model: per-layer (B, n_kv_heads, S, head_dim) tensors.

The model appends the keys and values of new tokens during `forward`; `length` (S) advances only
after every layer has written, so a forward that raises leaves the cache as it was. Storage grows
by doubling, so token-by-token decoding costs amortised O(1) copies per token.

For the rollout engine: rows of different lengths share one cache by right-padding to a common S
(`stack(..., pad_to)`), with the pads masked out by the caller's attention mask and positions given
explicitly; `split(valid)` takes rows apart again and drops the pad columns. `to_state`/`from_state`
move a cache between processes as plain CPU tensors.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch


class KVCache:
    """Per-layer keys and values; the first `length` positions of each buffer are valid."""

    def __init__(self, batch_size: int = 1) -> None:
        self._k: list[torch.Tensor] = []
        self._v: list[torch.Tensor] = []
        self.length = 0
        self._empty_batch = batch_size  # rows an empty cache stands for in stack / select / split

    # ----------------------------------------------------------------- inspection
    @property
    def num_layers(self) -> int:
        return len(self._k)

    @property
    def batch_size(self) -> int:
        return self._k[0].size(0) if self._k else self._empty_batch

    @property
    def capacity(self) -> int:
        return self._k[0].size(2) if self._k else 0

    @property
    def dtype(self) -> torch.dtype | None:
        return self._k[0].dtype if self._k else None

    @property
    def device(self) -> torch.device | None:
        return self._k[0].device if self._k else None

    @property
    def nbytes(self) -> int:
        """Bytes held by the valid positions (what a transfer of this cache moves)."""
        if not self._k:
            return 0
        k = self._k[0]
        per_layer = 2 * k.size(0) * k.size(1) * self.length * k.size(3) * k.element_size()
        return per_layer * self.num_layers

    def keys(self, layer: int) -> torch.Tensor:
        """Valid keys of `layer`: a (B, H_kv, length, D) view."""
        return self._k[layer][:, :, : self.length]

    def values(self, layer: int) -> torch.Tensor:
        """Valid values of `layer`: a (B, H_kv, length, D) view."""
        return self._v[layer][:, :, : self.length]

    def __repr__(self) -> str:
        return (
            f"KVCache(layers={self.num_layers}, batch={self.batch_size}, length={self.length}, "
            f"capacity={self.capacity}, dtype={self.dtype})"
        )

    # ----------------------------------------------------------------- writing (used by the model)
    def update(
        self, layer: int, k_new: torch.Tensor, v_new: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Write (B, H_kv, T, D) keys/values after position `length`; return keys/values up to length + T.

        `length` itself does not move until `advance(T)`, which the model calls after the last layer.
        """
        if layer > len(self._k):
            raise ValueError(f"KVCache.update: layer {layer} written before layer {len(self._k)}")
        new_len = self.length + k_new.size(2)
        if layer == len(self._k):
            if self.length:
                raise ValueError(
                    f"KVCache.update: layer {layer} missing from a cache of length {self.length}"
                )
            shape = (*k_new.shape[:2], max(new_len, 16), k_new.size(3))
            self._k.append(k_new.new_zeros(shape))
            self._v.append(v_new.new_zeros(shape))
        k_buf = self._k[layer]
        if k_new.shape[:2] != k_buf.shape[:2] or k_new.size(3) != k_buf.size(3):
            raise ValueError(
                f"KVCache.update: new keys {tuple(k_new.shape)} do not fit a cache of "
                f"(batch, heads, _, head_dim) = {(k_buf.size(0), k_buf.size(1), k_buf.size(3))}"
            )
        if new_len > k_buf.size(2):
            self._grow(layer, max(new_len, 2 * k_buf.size(2)))
        self._k[layer][:, :, self.length : new_len] = k_new
        self._v[layer][:, :, self.length : new_len] = v_new
        return self._k[layer][:, :, :new_len], self._v[layer][:, :, :new_len]

    def advance(self, n: int) -> None:
        """Mark `n` positions written by `update` (in every layer) as valid."""
        if self._k and self.length + n > self.capacity:
            raise ValueError(f"KVCache.advance({n}) beyond capacity {self.capacity}")
        self.length += n

    def reserve(self, capacity: int) -> KVCache:
        """Grow every layer's storage to hold at least `capacity` positions (avoids regrowth)."""
        for layer in range(self.num_layers):
            if self._k[layer].size(2) < capacity:
                self._grow(layer, capacity)
        return self

    def _grow(self, layer: int, capacity: int) -> None:
        for bufs in (self._k, self._v):
            old = bufs[layer]
            new = old.new_zeros((old.size(0), old.size(1), capacity, old.size(3)))
            new[:, :, : self.length] = old[:, :, : self.length]
            bufs[layer] = new

    # ----------------------------------------------------------------- reshaping (used by the engine)
    def truncate(self, n: int) -> KVCache:
        """Keep only the first `n` positions (in place); returns self."""
        if not 0 <= n <= self.length:
            raise ValueError(f"KVCache.truncate({n}) outside [0, length={self.length}]")
        self.length = n
        return self

    def clone(self) -> KVCache:
        """An independent copy of the valid positions."""
        return self._from_layers(
            [k[:, :, : self.length].clone() for k in self._k],
            [v[:, :, : self.length].clone() for v in self._v],
            self.length,
        )

    def to(self, device: torch.device | str | None = None, dtype: torch.dtype | None = None) -> KVCache:
        """A copy of the valid positions on `device` / in `dtype`."""
        return self._from_layers(
            [k[:, :, : self.length].to(device=device, dtype=dtype, copy=True) for k in self._k],
            [v[:, :, : self.length].to(device=device, dtype=dtype, copy=True) for v in self._v],
            self.length,
        )

    def select_rows(self, idx: Sequence[int] | torch.Tensor) -> KVCache:
        """A new cache holding rows `idx` (in that order) of this one."""
        index = torch.as_tensor(idx, dtype=torch.long, device=self.device)
        if not self._k:
            return KVCache(batch_size=int(index.numel()))
        return self._from_layers(
            [k[:, :, : self.length].index_select(0, index) for k in self._k],
            [v[:, :, : self.length].index_select(0, index) for v in self._v],
            self.length,
        )

    def select_columns(self, row: int, columns: torch.Tensor) -> KVCache:
        """A standalone single-row cache of row `row`'s positions where `columns` (length,) bool is True
        (one copy)."""
        if not self._k:
            return KVCache()
        cols = columns[: self.length].nonzero().squeeze(-1).to(self.device)
        return self._from_layers(
            [k[row : row + 1, :, : self.length].index_select(2, cols) for k in self._k],
            [v[row : row + 1, :, : self.length].index_select(2, cols) for v in self._v],
            int(cols.numel()),
        )

    @classmethod
    def stack(cls, caches: Sequence[KVCache], pad_to: int | None = None) -> KVCache:
        """Concatenate caches along the batch, right-padding each to `pad_to` (default: longest) with zeros.

        The pad columns hold zeros; the caller must mask them out in the attention mask.
        """
        if not caches:
            raise ValueError("KVCache.stack needs at least one cache")
        longest = max(c.length for c in caches)
        pad_to = longest if pad_to is None else pad_to
        if pad_to < longest:
            raise ValueError(f"KVCache.stack: pad_to={pad_to} is shorter than the longest cache ({longest})")
        layers = {c.num_layers for c in caches if c.num_layers}
        if len(layers) > 1:
            raise ValueError(f"KVCache.stack: caches have different layer counts {sorted(layers)}")
        filled = [c for c in caches if c.num_layers]
        if not filled:
            return cls(batch_size=sum(c.batch_size for c in caches))
        ref = filled[0]._k[0]

        def padded(c: KVCache, bufs: list[torch.Tensor], layer: int) -> torch.Tensor:
            if c.num_layers == 0:  # an empty cache: all its rows are pads
                return ref.new_zeros((c.batch_size, ref.size(1), pad_to, ref.size(3)))
            return torch.nn.functional.pad(bufs[layer][:, :, : c.length], (0, 0, 0, pad_to - c.length))

        ks = [torch.cat([padded(c, c._k, i) for c in caches], 0) for i in range(layers.pop())]
        vs = [torch.cat([padded(c, c._v, i) for c in caches], 0) for i in range(len(ks))]
        return cls._from_layers(ks, vs, pad_to)

    def split(self, valid: torch.Tensor | None = None) -> list[KVCache]:
        """One single-row cache per row; with `valid` (B, length) bool, keep only that row's True columns."""
        if valid is not None and tuple(valid.shape) != (self.batch_size, self.length):
            raise ValueError(
                f"KVCache.split: valid mask shape {tuple(valid.shape)} != (batch, length) "
                f"{(self.batch_size, self.length)}"
            )
        if not self._k:
            return [KVCache() for _ in range(self.batch_size)]
        rows = []
        for b in range(self.batch_size):
            if valid is None:
                cols = slice(0, self.length)
                n = self.length
            else:
                cols = valid[b].nonzero().squeeze(-1).to(self.device)
                n = int(cols.numel())
            rows.append(
                self._from_layers(
                    [k[b : b + 1, :, : self.length][:, :, cols].clone() for k in self._k],
                    [v[b : b + 1, :, : self.length][:, :, cols].clone() for v in self._v],
                    n,
                )
            )
        return rows

    # ----------------------------------------------------------------- transfer
    def to_state(self) -> dict[str, torch.Tensor]:
        """Valid positions as contiguous CPU tensors: {"k.{layer}": ..., "v.{layer}": ...}."""
        state: dict[str, torch.Tensor] = {}
        for layer in range(self.num_layers):
            state[f"k.{layer}"] = self.keys(layer).detach().to("cpu", copy=True).contiguous()
            state[f"v.{layer}"] = self.values(layer).detach().to("cpu", copy=True).contiguous()
        return state

    @classmethod
    def from_state(
        cls,
        state: dict[str, torch.Tensor],
        device: torch.device | str | None = None,
        dtype: torch.dtype | None = None,
    ) -> KVCache:
        """Rebuild a cache from `to_state()` output."""
        num_layers = sum(1 for key in state if key.startswith("k."))
        expected = {f"{kind}.{i}" for kind in "kv" for i in range(num_layers)}
        if set(state) != expected:
            raise ValueError(f"KVCache.from_state: keys {sorted(state)} are not {sorted(expected)}")
        ks = [state[f"k.{i}"].to(device=device, dtype=dtype, copy=True) for i in range(num_layers)]
        vs = [state[f"v.{i}"].to(device=device, dtype=dtype, copy=True) for i in range(num_layers)]
        lengths = {t.size(2) for t in ks + vs}
        if len(lengths) > 1:
            raise ValueError(f"KVCache.from_state: layers have different lengths {sorted(lengths)}")
        return cls._from_layers(ks, vs, lengths.pop() if lengths else 0)

    @classmethod
    def from_buffers(cls, ks: list[torch.Tensor], vs: list[torch.Tensor], length: int) -> KVCache:
        """A cache over existing per-layer (B, H_kv, capacity, D) buffers whose first `length` positions
        are valid (no copy: the cache takes the buffers over)."""
        if len(ks) != len(vs) or any(k.shape != v.shape for k, v in zip(ks, vs, strict=True)):
            raise ValueError("KVCache.from_buffers: keys and values must be per-layer buffers of one shape")
        if any(k.size(2) < length for k in ks):
            raise ValueError(f"KVCache.from_buffers: buffers shorter than length {length}")
        return cls._from_layers(ks, vs, length)

    @classmethod
    def _from_layers(cls, ks: list[torch.Tensor], vs: list[torch.Tensor], length: int) -> KVCache:
        cache = cls()
        cache._k, cache._v, cache.length = list(ks), list(vs), length
        return cache
