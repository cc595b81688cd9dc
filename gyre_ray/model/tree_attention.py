"""Tree attention straight from a `TreeLayout`: memory linear in the row, work about the visible pairs.

`plan_attention` (gyre_ray.model.attention) needs the dense (B, T, S) mask and keeps each query
block's sub-mask, so a long row costs T^2 bytes twice before any attention runs. Here each row is
planned from its segments alone. A query block of rows [start, stop) reads the key columns some
row can see, as a few column ranges; the columns every row of the block sees (its segments'
ancestors, and the block's own segment before the block) come first and need no mask; only the
rest, the block's own columns and whatever part of a sibling the block straddles, gets an explicit
(rows, columns) mask, built once at planning. Per call the block's mask is that tail behind a run
of True, alive for the one kernel call. For a chain of segments the stored masks are at most
rows x rows per block, so planning a 490k-token row keeps a few MiB where the dense mask took
223 GiB.

The kernel keeps each block's mask and gathered keys for the backward pass, which for a long row
adds up to T^2 again; past `RECOMPUTE_ABOVE_MASK_BYTES` a row's masked blocks are recomputed in the
backward pass instead (activation checkpointing of the attention alone). Rows of a micro-batch are
attended one at a time (each has its own blocks). Padding columns see only themselves, as in
`TreeLayout.dense`, so both routes give the same outputs.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch.utils.checkpoint import checkpoint

from gyre_ray.model.attention import BLOCK_QUERIES, MAX_SCORES_PER_CHUNK, fused_sdpa, sdpa_gqa
from gyre_ray.model.tree_layout import TreeLayout

Ranges = list[tuple[int, int]]  # sorted, disjoint, non-adjacent [lo, hi) column ranges
# Above this many mask bytes a row (rows x keys summed over its blocks, what the kernel would keep
# for the backward pass, with any gathered keys), a block's attention is recomputed in the backward
# pass instead of keeping them: a long row then holds O(T) per layer, not O(T^2), for some more CPU
# time (benchmarks/bench_tree_mask.py, a 16.7k-token row on the tiny model: peak 1.26 GiB against
# 3.18 GiB with the dense mask, 23.5 s against 21.2 s).
RECOMPUTE_ABOVE_MASK_BYTES = 1 << 22


def _add(ranges: Ranges, lo: int, hi: int) -> Ranges:
    """`ranges` plus [lo, hi), where lo is at or after the end of every range in it."""
    if hi <= lo:
        return ranges
    if ranges and ranges[-1][1] == lo:
        return [*ranges[:-1], (ranges[-1][0], hi)]
    return [*ranges, (lo, hi)]


def _union(a: Ranges, b: Ranges) -> Ranges:
    out: Ranges = []
    for lo, hi in sorted(a + b):
        if out and lo <= out[-1][1]:
            out[-1] = (out[-1][0], max(out[-1][1], hi))
        else:
            out.append((lo, hi))
    return out


def _intersect(a: Ranges, b: Ranges) -> Ranges:
    out: Ranges = []
    i = j = 0
    while i < len(a) and j < len(b):
        lo, hi = max(a[i][0], b[j][0]), min(a[i][1], b[j][1])
        if lo < hi:
            out.append((lo, hi))
        if a[i][1] < b[j][1]:
            i += 1
        else:
            j += 1
    return out


def _subtract(a: Ranges, b: Ranges) -> Ranges:
    out: Ranges = []
    for lo, hi in a:
        cursor = lo
        for b_lo, b_hi in b:
            if b_hi <= cursor or b_lo >= hi:
                continue
            if b_lo > cursor:
                out.append((cursor, b_lo))
            cursor = max(cursor, b_hi)
        if cursor < hi:
            out.append((cursor, hi))
    return out


def _width(ranges: Ranges) -> int:
    return sum(hi - lo for lo, hi in ranges)


@dataclass(frozen=True)
class TreeBlock:
    """Query rows [start, stop) of one batch row reading the key columns `ranges` (in that order).

    The first `shared` of those columns are visible to every row of the block; `tail` (rows, the
    rest) says which of the others each row sees, None when it sees them all.
    """

    start: int
    stop: int
    ranges: tuple[tuple[int, int], ...]
    shared: int
    tail: torch.Tensor | None

    @property
    def keys(self) -> int:
        return _width(list(self.ranges))


@dataclass(frozen=True)
class TreePlan:
    """Query blocks per batch row, for the `q_len` queries of the column ranges `q_ranges` (one range,
    all columns, unless query ranges were planned: a context-parallel rank's share), in that order,
    over the row's `key_len` keys (no cached past). A block lies in one range."""

    rows: tuple[tuple[TreeBlock, ...], ...]
    q_len: int
    recompute: bool = False  # recompute masked or gathered blocks in the backward pass (long rows)
    q_ranges: tuple[tuple[int, int], ...] = ()  # (): the columns [0, q_len)
    key_len: int = -1  # -1: as many keys as queries

    @property
    def keys_expected(self) -> int:
        return self.q_len if self.key_len < 0 else self.key_len

    def query_rows(self, block: TreeBlock) -> slice:
        """Where `block`'s queries lie in q (B, Hq, q_len, D): its columns less those of the ranges
        before its own."""
        before = 0
        for lo, hi in self.q_ranges:
            if lo <= block.start < hi:
                return slice(before + block.start - lo, before + block.stop - lo)
            before += hi - lo
        return slice(block.start, block.stop)

    @property
    def visited_pairs(self) -> int:
        """Query x key pairs the kernel computes, summed over rows."""
        return sum((b.stop - b.start) * b.keys for blocks in self.rows for b in blocks)

    @property
    def stored_mask_elements(self) -> int:
        """Mask entries the plan keeps (its memory), summed over rows."""
        return sum(b.tail.numel() for blocks in self.rows for b in blocks if b.tail is not None)


def _block_rows(heads: int, width: int) -> int:
    return max(1, min(BLOCK_QUERIES, MAX_SCORES_PER_CHUNK // max(1, heads * width)))


def _ancestors(segments: tuple[tuple[int, int, int], ...]) -> list[Ranges]:
    """Per segment, the columns of its ancestor segments (a parent comes earlier, so ends before it)."""
    seen: list[Ranges] = []
    for _start, _stop, parent in segments:
        seen.append([] if parent < 0 else _add(seen[parent], *segments[parent][:2]))
    return seen


def _in_ranges(columns: torch.Tensor, ranges: Ranges) -> torch.Tensor:
    inside = torch.zeros_like(columns, dtype=torch.bool)
    for lo, hi in ranges:
        inside |= (columns >= lo) & (columns < hi)
    return inside


def _real_block(
    segments: tuple[tuple[int, int, int], ...],
    ancestors: list[Ranges],
    first: int,
    start: int,
    stop: int,
    device: torch.device,
) -> TreeBlock:
    """The block of query rows [start, stop), whose first row lies in segment `first`."""
    parts = []  # (rows [lo, hi) of the block in this segment, columns all of them see, segment start)
    k = first
    while k < len(segments) and segments[k][0] < stop:
        seg_start, seg_stop, _ = segments[k]
        lo, hi = max(start, seg_start), min(stop, seg_stop)
        parts.append((lo, hi, _add(ancestors[k], seg_start, lo), seg_start))
        k += 1
    shared = parts[0][2]
    union: Ranges = []
    for lo, hi, seen, _ in parts:
        shared = _intersect(shared, seen)
        union = _union(union, _add(seen, lo, hi))
    rest = _subtract(union, shared)
    ranges = tuple(shared + rest)
    tail = None
    if rest:
        columns = torch.cat([torch.arange(lo, hi, device=device) for lo, hi in rest])
        tail = torch.zeros(stop - start, columns.numel(), dtype=torch.bool, device=device)
        for lo, hi, seen, seg_start in parts:
            query = torch.arange(lo, hi, device=device)[:, None]
            own = (columns[None] >= seg_start) & (columns[None] <= query)
            tail[lo - start : hi - start] = _in_ranges(columns, seen)[None] | own
        if bool(tail.all()):
            tail = None
    return TreeBlock(start, stop, ranges, _width(shared), tail)


def plan_tree(
    layout: TreeLayout,
    heads: int,
    device: torch.device | str = "cpu",
    queries: tuple[tuple[int, int], ...] | None = None,
) -> TreePlan:
    """Query blocks of every row of `layout` (built once per forward, shared by every layer); with
    `queries` (ascending, disjoint column ranges [lo, hi)) only those query columns of each row, in
    that order, over all its keys (a context-parallel rank's share of the row)."""
    device = torch.device(device)
    ranges = ((0, layout.width),) if queries is None else tuple((int(lo), int(hi)) for lo, hi in queries)
    previous = 0
    for lo, hi in ranges:
        if not previous <= lo <= hi <= layout.width:
            raise ValueError(
                f"query ranges {list(ranges)} are not ascending, disjoint ranges inside the rows' "
                f"{layout.width} columns"
            )
        previous = hi
    size = _block_rows(heads, max(1, layout.width))
    rows = []
    for r, segments in enumerate(layout.rows):
        ancestors = _ancestors(segments)
        real = layout.real_length(r)
        blocks = []
        first = 0
        for lo, hi in ranges:
            for start in range(lo, min(real, hi), size):
                stop = min(real, hi, start + size)
                while segments[first][1] <= start:
                    first += 1
                blocks.append(_real_block(segments, ancestors, first, start, stop, device))
            for start in range(max(real, lo), hi, size):  # padding: each column sees itself
                stop = min(hi, start + size)
                eye = torch.eye(stop - start, dtype=torch.bool, device=device)
                blocks.append(TreeBlock(start, stop, ((start, stop),), 0, eye))
        rows.append(tuple(blocks))
    # a block's mask is rows x keys bools: what the widest row's blocks would keep for the backward pass
    kept_mask_bytes = max((sum((b.stop - b.start) * b.keys for b in blocks) for blocks in rows), default=0)
    recompute = kept_mask_bytes > RECOMPUTE_ABOVE_MASK_BYTES
    q_len = sum(hi - lo for lo, hi in ranges)
    return TreePlan(tuple(rows), q_len, recompute, q_ranges=ranges, key_len=layout.width)


def _gather(x: torch.Tensor, ranges: tuple[tuple[int, int], ...]) -> torch.Tensor:
    if len(ranges) == 1:
        lo, hi = ranges[0]
        return x[:, :, lo:hi]
    return torch.cat([x[:, :, lo:hi] for lo, hi in ranges], dim=2)


def _block_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    ranges: tuple[tuple[int, int], ...],
    shared: int,
    tail: torch.Tensor | None,
) -> torch.Tensor:
    """One block: q (1, Hq, rows, D) over the key columns `ranges` of k, v (1, Hkv, T, D)."""
    mask = None
    if tail is not None:
        mask = torch.cat([tail.new_ones(tail.size(0), shared), tail], dim=1)[None, None]
    with fused_sdpa(q.device):
        return sdpa_gqa(q, _gather(k, ranges), _gather(v, ranges), attn_mask=mask)


def tree_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, plan: TreePlan) -> torch.Tensor:
    """Attention of q (B, Hq, Q, D), the plan's queries, over k, v (B, Hkv, T, D) following `plan`
    -> (B, Hq, Q, D)."""
    if q.size(0) != len(plan.rows) or q.size(2) != plan.q_len or k.size(2) != plan.keys_expected:
        raise ValueError(
            f"tree plan is for {len(plan.rows)} rows x {plan.q_len} queries over {plan.keys_expected} keys, "
            f"got q {tuple(q.shape)}, k {tuple(k.shape)}"
        )
    recompute = plan.recompute and torch.is_grad_enabled()
    outputs = []
    for b, blocks in enumerate(plan.rows):
        qb, kb, vb = q[b : b + 1], k[b : b + 1], v[b : b + 1]
        parts = []
        for block in blocks:
            args = (qb[:, :, plan.query_rows(block)], kb, vb, block.ranges, block.shared, block.tail)
            if recompute and (block.tail is not None or len(block.ranges) > 1):
                parts.append(checkpoint(_block_attention, *args, use_reentrant=False))
            else:
                parts.append(_block_attention(*args))
        outputs.append(parts[0] if len(parts) == 1 else torch.cat(parts, dim=2))
    return outputs[0] if len(outputs) == 1 else torch.cat(outputs, dim=0)
