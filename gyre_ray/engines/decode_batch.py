"""Running requests decoded together: one KV cache whose rows are right-padded to a common length.

Rows join with their own (single-row) cache and leave when finished, aborted or exported; rows
that join between two steps are stacked into the shared cache together, once. A `valid`
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
        self._cache = KVCache()
        self._valid = torch.zeros((0, 0), dtype=torch.bool, device=self.device)
        self._joining: list[KVCache] = []  # caches of rows added since the last step, stacked in one go

    def __len__(self) -> int:
        return len(self.rows)

    @property
    def length(self) -> int:
        return max([self._cache.length] + [c.length for c in self._joining])

    @property
    def cache(self) -> KVCache:
        self._settle()
        return self._cache

    @property
    def valid(self) -> torch.Tensor:
        self._settle()
        return self._valid

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
        """Append `request` as a new row; `cache` holds exactly its context minus the pending token.

        Rows added between two steps join the shared cache together (one stack, one copy each).
        """
        if cache.length != request.kv_target:
            raise ValueError(
                f"row {request.rid}: cache holds {cache.length} tokens, need {request.kv_target}"
            )
        self.rows.append(request)
        self._joining.append(cache)

    def _settle(self) -> None:
        if not self._joining:
            return
        joining, self._joining = self._joining, []
        lengths = torch.tensor([c.length for c in joining], device=self.device)
        width = max(self._cache.length, int(lengths.max()))
        columns = torch.arange(width, device=self.device)
        if self._valid.size(0) == 0 and len(joining) == 1:
            self._cache = joining[0]  # the first row: its cache is the batch's, no copy
        else:
            old = [self._cache] if self._valid.size(0) else []
            self._cache = KVCache.stack(old + joining, pad_to=width)
        old_valid = torch.nn.functional.pad(self._valid, (0, width - self._valid.size(1)), value=False)
        self._valid = torch.cat([old_valid, columns.unsqueeze(0) < lengths.unsqueeze(1)], 0)

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
        self._valid = torch.cat([self.valid, self._ones_column()], 1)

    def _ones_column(self) -> torch.Tensor:
        return torch.ones((len(self.rows), 1), dtype=torch.bool, device=self.device)

    def row_cache(self, index: int) -> KVCache:
        """A standalone single-row cache of row `index` (its valid columns only)."""
        return self.cache.select_columns(index, self.valid[index])

    def remove(self, indices: Sequence[int]) -> None:
        """Drop rows `indices`; compact when a column is unused or padding outweighs real tokens."""
        drop = set(indices)
        if not drop:
            return
        self._settle()
        keep = [i for i in range(len(self.rows)) if i not in drop]
        self.rows = [self.rows[i] for i in keep]
        if not keep:
            self._cache, self._valid = KVCache(), torch.zeros((0, 0), dtype=torch.bool, device=self.device)
            return
        self._cache = self._cache.select_rows(keep)
        self._valid = self._valid[keep]
        real = int(self._valid.sum())
        if not bool(self._valid.any(0).all()) or self._valid.numel() - real > real:
            self.compact()  # columns no row uses, or more padding than tokens

    def compact(self) -> None:
        """Move each row's columns to the front and cut the cache to the longest row."""
        rows = self.cache.split(self.valid)
        self._cache = KVCache.stack(rows)
        lengths = torch.tensor([c.length for c in rows], device=self.device)
        self._valid = torch.arange(self._cache.length, device=self.device).unsqueeze(0) < lengths.unsqueeze(1)
