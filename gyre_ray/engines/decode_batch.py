"""Running requests decoded together: one KV cache whose rows are right-padded to a common length.

Rows join with their own (single-row) cache and leave when finished, aborted or exported. A `valid`
mask (rows x cache columns) remembers which columns belong to each row; it becomes the attention
mask of the next decode step, together with each row's true position. When rows leave columns
that no row uses, or more than half of the cells are padding, the batch compacts itself (each
row's columns moved to the front).
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from gyre_ray.engines.requests import ActiveRequest
from gyre_ray.model.kv_cache import KVCache


class DecodeBatch:
    """A group of running requests and their shared, padded KV cache."""

    def __init__(self, device: torch.device | str = "cpu") -> None:
        self.device = torch.device(device)
        self.rows: list[ActiveRequest] = []
        self.cache = KVCache()
        self.valid = torch.zeros((0, 0), dtype=torch.bool, device=self.device)

    def __len__(self) -> int:
        return len(self.rows)

    @property
    def length(self) -> int:
        return self.cache.length

    def join_cost(self, length: int, max_padding_ratio: float) -> int | None:
        """Padding cells if a row with `length` cached tokens joined; None if it should not join.

        It should not when some row would then hold fewer than 1 / (1 + max_padding_ratio) of the
        batch width in real tokens (a short request next to a very long one would pay the long one's
        attention cost at every step).
        """
        lengths = [r.kv_target for r in self.rows] + [length]
        width = max(self.length, length)
        if min(lengths) * (1 + max_padding_ratio) < width:
            return None
        return len(lengths) * width - sum(lengths)

    def add(self, request: ActiveRequest, cache: KVCache) -> None:
        """Append `request` as a new row; `cache` holds exactly its context minus the pending token."""
        if cache.length != request.kv_target:
            raise ValueError(
                f"row {request.rid}: cache holds {cache.length} tokens, need {request.kv_target}"
            )
        if not self.rows:
            self.cache = cache
            self.valid = torch.ones((1, cache.length), dtype=torch.bool, device=self.device)
        else:
            width = max(self.length, cache.length)
            self.cache = KVCache.stack([self.cache, cache], pad_to=width)
            old = torch.nn.functional.pad(self.valid, (0, width - self.valid.size(1)), value=False)
            new = torch.zeros((1, width), dtype=torch.bool, device=self.device)
            new[0, : cache.length] = True
            self.valid = torch.cat([old, new], 0)
        self.rows.append(request)

    def step_inputs(self) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]:
        """(input_ids (B,1), position_ids (B,1), attention mask (B,1,S+1) or None when nothing is padded)."""
        tokens = torch.tensor([[r.output_ids[-1]] for r in self.rows], dtype=torch.long, device=self.device)
        positions = torch.tensor([[r.kv_target] for r in self.rows], dtype=torch.long, device=self.device)
        if bool(self.valid.all()):
            return tokens, positions, None
        mask = torch.cat([self.valid, self._ones_column()], 1)
        return tokens, positions, mask.unsqueeze(1)

    def after_step(self) -> None:
        """Every row wrote one column (its pending token) in the last forward."""
        self.valid = torch.cat([self.valid, self._ones_column()], 1)

    def _ones_column(self) -> torch.Tensor:
        return torch.ones((len(self.rows), 1), dtype=torch.bool, device=self.device)

    def row_cache(self, index: int) -> KVCache:
        """A standalone single-row cache of row `index` (its valid columns only)."""
        return self.cache.select_rows([index]).split(self.valid[index : index + 1])[0]

    def remove(self, indices: Sequence[int]) -> None:
        """Drop rows `indices`; compact when a column is unused or padding outweighs real tokens."""
        drop = set(indices)
        if not drop:
            return
        keep = [i for i in range(len(self.rows)) if i not in drop]
        self.rows = [self.rows[i] for i in keep]
        if not keep:
            self.cache, self.valid = KVCache(), torch.zeros((0, 0), dtype=torch.bool, device=self.device)
            return
        self.cache = self.cache.select_rows(keep)
        self.valid = self.valid[keep]
        real = int(self.valid.sum())
        if not bool(self.valid.any(0).all()) or self.valid.numel() - real > real:
            self.compact()  # columns no row uses, or more padding than tokens

    def compact(self) -> None:
        """Move each row's columns to the front and cut the cache to the longest row."""
        rows = self.cache.split(self.valid)
        self.cache = KVCache.stack(rows)
        lengths = torch.tensor([c.length for c in rows], device=self.device)
        self.valid = torch.arange(self.cache.length, device=self.device).unsqueeze(0) < lengths.unsqueeze(1)
