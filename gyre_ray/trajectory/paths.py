"""Root-to-leaf paths of a call tree, their roles, and the budgeted selection of which to train on.

A path's role is the highest-priority role among the calls that end on it
(main > main-summary > sub-agent > sub-agent-summary). Only paths with loss tokens (something the
model generated) are candidates, unless none has any. The *main path* (the candidate holding the
last main call to finish) is always kept; the other candidates follow by role priority, then by
the configured tie-break, each only if it adds loss tokens no path kept so far holds, until
`budget` paths are chosen.
"""

from __future__ import annotations

from dataclasses import dataclass

from gyre_ray.trajectory.roles import ROLE_PRIORITY
from gyre_ray.trajectory.tree import CallTree, Node

TIE_BREAKS = ("longest", "latest", "earliest")


@dataclass(eq=False)
class TreePath:
    """One root-to-leaf path: its nodes, the calls that end on it, and its role."""

    index: int
    nodes: list[Node]
    calls: list[int]
    role: str
    num_tokens: int
    num_loss_tokens: int
    t_start: float
    t_end: float

    @property
    def leaf(self) -> Node:
        return self.nodes[-1]


def tree_paths(tree: CallTree, roles: list[str]) -> list[TreePath]:
    """Every root-to-leaf path of `tree`, in depth-first order; `roles` is one role per call."""
    if len(roles) != len(tree.calls):
        raise ValueError(f"got {len(roles)} roles for {len(tree.calls)} calls")
    ends_at: dict[int, list[int]] = {}
    for call, (node, _) in tree.call_ends().items():
        ends_at.setdefault(node.id, []).append(call)
    paths = []
    for index, leaf in enumerate(tree.leaves()):
        nodes = leaf.ancestors()
        calls = sorted(c for node in nodes for c in ends_at.get(node.id, []))
        role = min((roles[c] for c in calls), key=lambda r: ROLE_PRIORITY.get(r, len(ROLE_PRIORITY)))
        paths.append(
            TreePath(
                index=index,
                nodes=nodes,
                calls=calls,
                role=role,
                num_tokens=leaf.end_depth,
                num_loss_tokens=sum(sum(node.loss) for node in nodes),
                t_start=min(tree.calls[c].t_start for c in calls),
                t_end=max(tree.calls[c].t_end for c in calls),
            )
        )
    return paths


def main_path(paths: list[TreePath], tree: CallTree, roles: list[str]) -> TreePath:
    """The path of `paths` holding the main agent's last call (by end time) among those on `paths`;
    if none is `main`, the best-role, latest-ending path."""
    if not paths:
        raise ValueError("an execution without calls has no main path")
    on_paths = {c for p in paths for c in p.calls}
    mains = [c for c, r in enumerate(roles) if r == "main" and c in on_paths]
    if mains:
        last = max(mains, key=lambda c: (tree.calls[c].t_end, tree.calls[c].t_start, c))
        return next(p for p in paths if last in p.calls)
    return min(paths, key=lambda p: (ROLE_PRIORITY.get(p.role, 9), -p.t_end, p.index))


def _tie_key(path: TreePath, tie_break: str) -> tuple:
    if tie_break == "longest":
        return (-path.num_loss_tokens, -path.num_tokens, path.index)
    if tie_break == "latest":
        return (-path.t_end, path.index)
    if tie_break == "earliest":
        return (path.t_start, path.index)
    raise ValueError(f"tie_break must be one of {', '.join(TIE_BREAKS)}, got {tie_break!r}")


def select_paths(
    paths: list[TreePath], tree: CallTree, roles: list[str], budget: int = 5, tie_break: str = "longest"
) -> list[TreePath]:
    """At most `budget` paths: the main path first, then by role priority and `tie_break`.

    A path without loss tokens (say, the main agent's last call, cut off at the timeout before it
    generated anything, on a path of its own) trains nothing, so it takes no place while any path
    has loss tokens; nor does one whose loss tokens are all on paths already kept (a call aborted
    before it generated anything, hanging off the main context, counts the main context's tokens
    as its own).
    """
    if budget < 1:
        raise ValueError(f"budget must be >= 1, got {budget}")
    if tie_break not in TIE_BREAKS:
        raise ValueError(f"tie_break must be one of {', '.join(TIE_BREAKS)}, got {tie_break!r}")
    if not paths:
        return []
    candidates = [p for p in paths if p.num_loss_tokens > 0] or paths
    first = main_path(candidates, tree, roles)
    rest = sorted(
        (p for p in candidates if p is not first),
        key=lambda p: (ROLE_PRIORITY.get(p.role, len(ROLE_PRIORITY)), *_tie_key(p, tie_break)),
    )
    if first.num_loss_tokens == 0:  # nothing to train anywhere: the order alone
        return [first, *rest[: budget - 1]]
    chosen, covered = [first], {node.id for node in first.nodes}
    for path in rest:
        if len(chosen) == budget:
            break
        if not any(node.id not in covered and any(node.loss) for node in path.nodes):
            continue  # every token it would train is on a path already kept: it would take a place for nothing
        chosen.append(path)
        covered.update(node.id for node in path.nodes)
    return chosen
