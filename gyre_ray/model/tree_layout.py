"""The attention structure of packed prefix-tree rows, kept as segments instead of a dense mask.

A packed row (`gyre_ray.trajectory.batching`) lays one or more trees out depth first: each tree
node is a segment of consecutive columns, and a column sees the columns of every ancestor segment
plus its own segment up to itself. Padding columns after the row's last segment see only
themselves. `TreeLayout` holds those segments, which take O(segments) memory where the dense
(B, T, T) mask takes T^2 bytes a row (490k-token rows of long agent executions: 223 GiB);
`gyre_ray.model.tree_attention` turns it into query blocks without ever forming that mask, and
`dense()` gives the mask itself where a backend needs one (or the row is short).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

Segment = tuple[int, int, int]  # (start, stop, parent segment index or -1)


@dataclass(frozen=True)
class TreeLayout:
    """Per batch row, its tree segments in column order; every row is `width` columns wide."""

    width: int
    rows: tuple[tuple[Segment, ...], ...]

    def __post_init__(self) -> None:
        problem = self.problem()
        if problem:
            raise ValueError(f"invalid tree layout: {problem}")

    @property
    def batch(self) -> int:
        return len(self.rows)

    def real_length(self, row: int) -> int:
        """Columns of `row` that belong to a segment (the rest is padding)."""
        segments = self.rows[row]
        return segments[-1][1] if segments else 0

    def problem(self) -> str | None:
        """What makes this layout unusable, or None: segments must tile [0, real length) in order,
        each parent an earlier segment, and fit the width."""
        if self.width < 0:
            return f"width must be >= 0, got {self.width}"
        for r, segments in enumerate(self.rows):
            expected_start = 0
            for k, (start, stop, parent) in enumerate(segments):
                if start != expected_start or stop <= start:
                    return (
                        f"row {r} segment {k} spans [{start}, {stop}); segments must be non-empty and "
                        f"consecutive from column 0 (expected a start of {expected_start})"
                    )
                if not -1 <= parent < k:
                    return (
                        f"row {r} segment {k} has parent {parent}; a parent must be an earlier segment or -1"
                    )
                expected_start = stop
            if expected_start > self.width:
                return f"row {r} holds {expected_start} columns, more than the width {self.width}"
        return None

    def dense(self, device: torch.device | str | None = None) -> torch.Tensor:
        """(B, width, width) bool mask: True where a column may attend to a column."""
        mask = torch.zeros(self.batch, self.width, self.width, dtype=torch.bool, device=device)
        for r, segments in enumerate(self.rows):
            row = mask[r]
            for start, stop, parent in segments:
                if parent >= 0:
                    row[start:stop] |= row[segments[parent][1] - 1]
                row[start:stop, start:stop] = torch.ones(
                    stop - start, stop - start, dtype=torch.bool, device=device
                ).tril()
            pad = torch.arange(self.real_length(r), self.width, device=device)
            row[pad, pad] = True
        return mask

    def visible_pairs(self) -> int:
        """Query x key pairs the mask allows, summed over rows (the work of exact tree attention)."""
        total = 0
        for r, segments in enumerate(self.rows):
            seen_before = [0] * len(segments)  # columns of a segment's ancestors
            for k, (start, stop, parent) in enumerate(segments):
                if parent >= 0:
                    p_start, p_stop, _ = segments[parent]
                    seen_before[k] = seen_before[parent] + (p_stop - p_start)
                n = stop - start
                total += n * seen_before[k] + n * (n + 1) // 2
            total += self.width - self.real_length(r)
        return total
