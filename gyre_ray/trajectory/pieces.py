"""Cutting a packed sample (`packing.Sample`, one execution's tree) into shorter pieces, exactly.

- `split_roots`: one piece per top-level root. Roots never attend to each other, so nothing is
  repeated.
- `split_long`: that, and then a piece longer than `max_tokens` is cut at its topmost branch point
  whose shared prefix (the tokens from the piece's top down to the branch) holds no loss token: one
  piece per branch, each starting with its own copy of that prefix. In an agent's tree such a prefix
  is a system prompt: the contexts a compaction starts share only it with the ones before, a
  sub-agent only the chat template's header. A piece still too long is cut again below; one without
  such a branch point (a single context) stays as it is.

Every column of a piece sees exactly the ancestors it saw in the sample (the prefix copy is its
ancestry), and each path lies whole in one piece with its columns and weights, so a piece's loss
terms are the sample's: the split is exact. Because a copied prefix holds no loss token, every loss
token is still in exactly one piece (`loss_mask` counts it once); the copies cost the forward and
backward of the prefix tokens once more per extra piece, nothing else.
"""

from __future__ import annotations

from gyre_ray.trajectory.packing import Sample


def split_roots(sample: Sample) -> list[Sample]:
    """One piece per top-level root (`split_long` with no length limit)."""
    return split_long(sample, 0)


def split_long(sample: Sample, max_tokens: int) -> list[Sample]:
    """`sample` cut into one piece per root, and pieces longer than `max_tokens` (0: no limit) cut
    further at branch points whose shared prefix holds no loss token (module docstring)."""
    if max_tokens < 0:
        raise ValueError(f"max_tokens must be >= 0, got {max_tokens}")
    tops = [k for k, (_, _, parent) in enumerate(sample.segments) if parent < 0]
    if len(tops) <= 1 and (not max_tokens or sample.num_tokens <= max_tokens):
        return [sample]
    tree = _Segments(sample)
    cuts: list[tuple[list[int], int]] = []  # (prefix segments, body segment) per piece, in order
    for top in tops:
        tree.cut([], top, max_tokens, cuts)
    return [
        _piece(sample, tree, prefix, body, index if len(cuts) > 1 else None)
        for index, (prefix, body) in enumerate(cuts)
    ]


class _Segments:
    """The sample's segments as a tree: children, subtree extents, lengths and loss-token counts."""

    def __init__(self, sample: Sample) -> None:
        self.segments = sample.segments
        count = len(sample.segments)
        self.children: list[list[int]] = [[] for _ in range(count)]
        for k, (_, _, parent) in enumerate(sample.segments):
            if parent >= 0:
                self.children[parent].append(k)
        # depth-first layout: a segment's subtree is it and the segments after it up to `last[k]`
        self.last = list(range(count))
        for k in reversed(range(count)):
            parent = sample.segments[k][2]
            if parent >= 0:
                self.last[parent] = max(self.last[parent], self.last[k])
        self.length = [stop - start for start, stop, _ in sample.segments]
        self.loss = [sum(sample.loss_mask[start:stop]) for start, stop, _ in sample.segments]

    def tokens_under(self, body: int) -> int:
        """Columns of `body`'s subtree."""
        return self.segments[self.last[body]][1] - self.segments[body][0]

    def cut(self, prefix: list[int], body: int, max_tokens: int, out: list[tuple[list[int], int]]) -> None:
        """Append the pieces of `prefix` + `body`'s subtree to `out`, cutting while too long."""
        size = sum(self.length[k] for k in prefix) + self.tokens_under(body)
        chain, node = [body], body
        while len(self.children[node]) == 1:  # down to the topmost branch point
            node = self.children[node][0]
            chain.append(node)
        shared = prefix + chain
        if (
            not max_tokens
            or size <= max_tokens
            or not self.children[node]
            or any(self.loss[k] for k in shared)
        ):
            out.append((prefix, body))
            return
        for child in self.children[node]:
            self.cut(shared, child, max_tokens, out)


def _piece(sample: Sample, tree: _Segments, prefix: list[int], body: int, index: int | None) -> Sample:
    """The piece made of copies of the `prefix` segments, then `body`'s whole subtree."""
    seg_ids = prefix + list(range(body, tree.last[body] + 1))
    new_seg = {old: new for new, old in enumerate(seg_ids)}
    columns = [c for k in seg_ids for c in range(tree.segments[k][0], tree.segments[k][1])]
    new_col = {old: new for new, old in enumerate(columns)}
    segments, parent_index, start = [], [], 0
    for k in seg_ids:
        first, stop, parent_seg = tree.segments[k]
        up = new_seg.get(parent_seg, -1) if k != body else (new_seg[prefix[-1]] if prefix else -1)
        segments.append((start, start + stop - first, up))
        parent_index.append(-1 if up < 0 else segments[up][1] - 1)
        parent_index.extend(range(start, start + stop - first - 1))
        start += stop - first
    lo, hi = tree.segments[body][0], tree.segments[tree.last[body]][1]
    keep = [k for k, cols in enumerate(sample.path_columns) if cols and lo <= cols[-1] < hi]
    meta = dict(sample.meta)
    if index is not None:
        meta.update(piece=index, prefix_tokens=sum(tree.length[k] for k in prefix))
    return Sample(
        execution_id=sample.execution_id,
        input_ids=[sample.input_ids[c] for c in columns],
        position_ids=[sample.position_ids[c] for c in columns],
        parent_index=parent_index,
        segments=segments,
        loss_mask=[sample.loss_mask[c] for c in columns],
        old_logprobs=[sample.old_logprobs[c] for c in columns],
        versions=[sample.versions[c] for c in columns],
        path_columns=[[new_col[c] for c in sample.path_columns[k]] for k in keep],
        path_weights=[list(sample.path_weights[k]) for k in keep],
        path_roles=[sample.path_roles[k] for k in keep],
        advantage=sample.advantage,
        meta=meta,
    )
