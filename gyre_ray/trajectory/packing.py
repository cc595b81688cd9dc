"""Selected paths -> one training sample, laid out once as a tree ("packed") or one row per path.

Packed layout: the union of the selected paths' nodes in depth-first order, each token once;
`position_ids` = depth along its path; `parent_index[j]` = column of token j's predecessor (the
branch point for the first token of a branch, -1 for the first token of a root); the attention
mask lets a column see exactly its ancestors and itself. Only model-generated tokens carry loss.

Loss weights (per execution, "each output token counted once"): with N the number of distinct
loss tokens in the sample and n_t the number of selected paths through loss token t, path i gives
token t the weight 1 / (n_t * N). The weights of an execution sum to 1, so the execution's loss is
a token mean and a long or branchy execution does not outweigh a short one. The GSPO sequence
ratio of a path is taken over all its loss tokens (see `gyre_ray.algo.gspo.tree_gspo_loss`).
The expanded layout (one row per path) carries the same weights, so both layouts define the same
objective; `weights="per_path"` gives the plain alternative (each path a token mean, paths averaged).
"""

from __future__ import annotations

from dataclasses import dataclass, field

from gyre_ray.trajectory.paths import TreePath
from gyre_ray.trajectory.tree import Node


@dataclass
class Sample:
    """One execution's training tokens (a tree, or one path of it), before batching."""

    execution_id: str
    input_ids: list[int]
    position_ids: list[int]
    parent_index: list[int]
    segments: list[tuple[int, int, int]]  # (start, stop, parent segment or -1): one tree node each
    loss_mask: list[bool]
    old_logprobs: list[float]
    versions: list[int]
    path_columns: list[list[int]]  # per path: the columns of its loss tokens
    path_weights: list[list[float]]  # per path: the weight of each of those columns
    path_roles: list[str]
    advantage: float = 0.0
    meta: dict = field(default_factory=dict)

    @property
    def num_tokens(self) -> int:
        return len(self.input_ids)

    @property
    def num_loss_tokens(self) -> int:
        return sum(self.loss_mask)


def _layout(nodes: list[Node]) -> tuple[dict[int, int], list[Node]]:
    """Depth-first order of `nodes` (which must be closed under parent) -> start column per node id."""
    chosen = {n.id for n in nodes}
    roots = [n for n in nodes if n.parent is None or n.parent.id not in chosen]
    order: list[Node] = []
    stack = sorted(roots, key=lambda n: -n.id)
    while stack:
        node = stack.pop()
        order.append(node)
        stack.extend(sorted((c for c in node.children.values() if c.id in chosen), key=lambda n: -n.id))
    starts, col = {}, 0
    for node in order:
        starts[node.id] = col
        col += len(node.tokens)
    return starts, order


def _weights(path_columns: list[list[int]], scheme: str) -> list[list[float]]:
    if scheme == "per_path":
        live = [cols for cols in path_columns if cols]
        return [[1.0 / (len(cols) * len(live))] * len(cols) if cols else [] for cols in path_columns]
    if scheme != "count_once":
        raise ValueError(f"weights must be 'count_once' or 'per_path', got {scheme!r}")
    uses: dict[int, int] = {}
    for cols in path_columns:
        for c in cols:
            uses[c] = uses.get(c, 0) + 1
    total = len(uses)
    return [[1.0 / (uses[c] * total) for c in cols] for cols in path_columns]


def pack_paths(
    execution_id: str, paths: list[TreePath], advantage: float = 0.0, weights: str = "count_once"
) -> Sample:
    """The selected paths as one tree sample, every shared token laid out once."""
    if not paths:
        raise ValueError(f"execution {execution_id!r}: no paths to pack")
    nodes = list({n.id: n for p in paths for n in p.nodes}.values())
    starts, order = _layout(nodes)
    seg_of = {node.id: k for k, node in enumerate(order)}
    ids, pos, parent, loss, old, ver, segments = [], [], [], [], [], [], []
    for node in order:
        start = starts[node.id]
        up = node.parent if node.parent is not None and node.parent.id in starts else None
        first_parent = -1 if up is None else starts[up.id] + len(up.tokens) - 1
        ids.extend(node.tokens)
        pos.extend(range(node.depth, node.end_depth))
        parent.append(first_parent)
        parent.extend(range(start, start + len(node.tokens) - 1))
        loss.extend(node.loss)
        old.extend(lp if keep else 0.0 for lp, keep in zip(node.logprobs, node.loss, strict=True))
        ver.extend(node.versions)
        segments.append((start, start + len(node.tokens), -1 if up is None else seg_of[up.id]))
    path_columns = [
        [starts[n.id] + k for n in p.nodes for k, is_loss in enumerate(n.loss) if is_loss] for p in paths
    ]
    return Sample(
        execution_id=execution_id,
        input_ids=ids,
        position_ids=pos,
        parent_index=parent,
        segments=segments,
        loss_mask=loss,
        old_logprobs=old,
        versions=ver,
        path_columns=path_columns,
        path_weights=_weights(path_columns, weights),
        path_roles=[p.role for p in paths],
        advantage=advantage,
        meta={"layout": "packed", "paths": len(paths)},
    )


def expand_paths(
    execution_id: str, paths: list[TreePath], advantage: float = 0.0, weights: str = "count_once"
) -> list[Sample]:
    """One plain left-to-right sample per path; shared tokens repeated, weights as in `pack_paths`."""
    packed = pack_paths(execution_id, paths, advantage, weights)
    rows = []
    for p, cols, wts in zip(paths, packed.path_columns, packed.path_weights, strict=True):
        tokens = [t for n in p.nodes for t in n.tokens]
        loss = [flag for n in p.nodes for flag in n.loss]
        lps = [lp if f else 0.0 for n in p.nodes for lp, f in zip(n.logprobs, n.loss, strict=True)]
        columns = [j for j, flag in enumerate(loss) if flag]
        # The path's loss tokens come in the same order in both layouts, so weights carry over.
        assert len(columns) == len(cols)
        rows.append(
            Sample(
                execution_id=execution_id,
                input_ids=tokens,
                position_ids=list(range(len(tokens))),
                parent_index=list(range(-1, len(tokens) - 1)),
                segments=[(0, len(tokens), -1)],
                loss_mask=loss,
                old_logprobs=lps,
                versions=[v for n in p.nodes for v in n.versions],
                path_columns=[columns],
                path_weights=[list(wts)],
                path_roles=[p.role],
                advantage=advantage,
                meta={"layout": "expanded", "path": p.index},
            )
        )
    return rows
