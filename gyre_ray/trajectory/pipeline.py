"""Records -> tree -> roles -> selected paths -> packed samples -> micro-batches, in one call.

`build_training_batches` is what the training job uses once a group of executions has ended:

    trainer = make_trainer(cfg.trainer, model, args, get_loss("gspo", cfg.algo))
    batches = build_training_batches(records_by_execution, rewards, group_ids, cfg)
    for b in batches: trainer.forward_backward(b)
    trainer.optimizer_step(step_scale(batches))   # 1 / executions in the step

An execution whose advantage is 0 (its group's rewards are all equal) has a gradient of exactly
zero: unless `algo.train_zero_advantage` is set, it is left out of the micro-batches and named in the
first one's `meta["untrained_execution_ids"]` instead, so that `step_scale` still counts it and the
update is the same, for none of its forward and backward.

`cfg` is the root config (`GyreConfig`, whose `trajectory` and `algo` sections are used) or a
`TrajectorySection` alone (GSPO advantage defaults then apply).
"""

from __future__ import annotations

from collections.abc import Hashable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from gyre_ray.algo.advantages import ZERO_ADVANTAGE, group_advantages
from gyre_ray.algo.config import AlgoSection
from gyre_ray.trainers.batch import MicroBatch
from gyre_ray.trajectory.batching import micro_batches
from gyre_ray.trajectory.config import TrajectorySection
from gyre_ray.trajectory.packing import Sample, expand_paths, pack_paths
from gyre_ray.trajectory.paths import TreePath, select_paths, tree_paths
from gyre_ray.trajectory.pieces import split_long
from gyre_ray.trajectory.records import CallRecord
from gyre_ray.trajectory.roles import classify_roles
from gyre_ray.trajectory.tree import CallTree, Decode

# The token figures of `ProcessedExecution.stats()` that add up over executions (traj show, benchmark).
TOKEN_FIGURES = (
    "paths_total",
    "paths_selected",
    "tokens_expanded_all",
    "tokens_packed_all",
    "tokens_expanded_selected",
    "tokens_packed_selected",
    "loss_tokens_all",
    "loss_tokens_selected",
)


@dataclass
class ProcessedExecution:
    """An execution's tree with its call roles, all paths and the selected ones (main path first)."""

    tree: CallTree
    roles: list[str]
    paths: list[TreePath]
    selected: list[TreePath]

    @property
    def execution_id(self) -> str:
        return self.tree.execution_id

    def stats(self) -> dict[str, Any]:
        """Token figures of all paths vs the selected ones, expanded (one row per path) vs packed."""
        chosen = {n.id: n for p in self.selected for n in p.nodes}
        roles = {r: self.roles.count(r) for r in sorted(set(self.roles))}
        return {
            "execution_id": self.execution_id,
            "calls": len(self.tree.calls),
            "call_roles": roles,
            "paths_total": len(self.paths),
            "paths_selected": len(self.selected),
            "selected_roles": [p.role for p in self.selected],
            "tokens_expanded_all": sum(p.num_tokens for p in self.paths),
            "tokens_packed_all": self.tree.num_tokens,
            "tokens_expanded_selected": sum(p.num_tokens for p in self.selected),
            "tokens_packed_selected": sum(len(n.tokens) for n in chosen.values()),
            "loss_tokens_all": sum(sum(n.loss) for n in self.tree.nodes()),
            "loss_tokens_selected": sum(sum(n.loss) for n in chosen.values()),
            "drift_remapped": len(self.tree.drift),
        }


def _sections(cfg: Any) -> tuple[TrajectorySection, AlgoSection]:
    if isinstance(cfg, TrajectorySection):
        return cfg, AlgoSection()
    if cfg is None:
        return TrajectorySection(), AlgoSection()
    return cfg.trajectory, cfg.algo


def process_execution(
    records: Sequence[CallRecord],
    cfg: TrajectorySection | None = None,
    decode: Decode | None = None,
    vocab_size: int | None = None,
    budget: int | None = None,
) -> ProcessedExecution:
    """Validate, build the tree, classify `unknown` roles and select at most `budget` paths."""
    cfg = cfg or TrajectorySection()
    tree = CallTree.build(records, decode=decode, vocab_size=vocab_size)
    roles = classify_roles(tree, cfg, decode)
    paths = tree_paths(tree, roles)
    selected = select_paths(paths, tree, roles, budget or cfg.budget, cfg.tie_break)
    return ProcessedExecution(tree, roles, paths, selected)


def execution_samples(
    processed: ProcessedExecution, advantage: float, layout: str = "packed", all_paths: bool = False
) -> list[Sample]:
    """The training sample(s) of one processed execution: one packed tree, or one row per path."""
    paths = processed.paths if all_paths else processed.selected
    if layout == "packed":
        return [pack_paths(processed.execution_id, paths, advantage)]
    if layout == "expanded":
        return expand_paths(processed.execution_id, paths, advantage)
    raise ValueError(f"layout must be 'packed' or 'expanded', got {layout!r}")


def build_training_batches(
    records_by_execution: Mapping[str, Sequence[CallRecord]],
    rewards: Mapping[str, float],
    group_ids: Mapping[str, Hashable],
    cfg: Any = None,
    decode: Decode | None = None,
    vocab_size: int | None = None,
    layout: str = "packed",
) -> list[MicroBatch]:
    """Micro-batches for the tree GSPO loss (see `training_batches_with_stats`, which also returns tree figures)."""
    batches, _ = training_batches_with_stats(
        records_by_execution, rewards, group_ids, cfg, decode, vocab_size, layout
    )
    return batches


def training_batches_with_stats(
    records_by_execution: Mapping[str, Sequence[CallRecord]],
    rewards: Mapping[str, float],
    group_ids: Mapping[str, Hashable],
    cfg: Any = None,
    decode: Decode | None = None,
    vocab_size: int | None = None,
    layout: str = "packed",
) -> tuple[list[MicroBatch], list[dict[str, Any]]]:
    """Micro-batches for the tree GSPO loss from a set of finished, rewarded executions, and each
    execution's `ProcessedExecution.stats()` (every tree is built once, for both), with
    `training`: "trained", `ZERO_ADVANTAGE` (left out: module docstring) or "no loss tokens".

    Advantages are normalised within each group (`group_ids[execution] -> task key`) over the
    executions that have a reward. Executions without records or without model-generated tokens
    are skipped (they carry no loss). Every execution in `records_by_execution` needs a reward and a group id.
    Packed trees are cut into one piece per root, and a tree longer than
    `trajectory.max_piece_tokens` at branch points below a loss-free prefix (`split_long`, exact);
    `layout="expanded"` gives one plain row per selected path instead (for comparison).
    """
    traj_cfg, algo_cfg = _sections(cfg)
    missing = [e for e in records_by_execution if e not in rewards]
    if missing:
        raise KeyError(f"executions without a reward: {', '.join(sorted(missing))}")
    advantages = group_advantages(rewards, group_ids, algo_cfg.normalize_std, algo_cfg.advantage_eps)
    samples: list[Sample] = []
    stats: list[dict[str, Any]] = []
    untrained: list[str] = []
    for execution_id, records in records_by_execution.items():
        if not records:  # no model calls: nothing to train on (the runner drops such executions)
            continue
        for record in records:
            if record.execution_id != execution_id:
                raise ValueError(
                    f"record {record.call_id!r} has execution_id {record.execution_id!r} "
                    f"but is listed under {execution_id!r}"
                )
        processed = process_execution(records, traj_cfg, decode, vocab_size)
        figures = processed.stats()
        if algo_cfg.train_zero_advantage or advantages[execution_id] != 0.0:
            pieces = [
                piece
                for sample in execution_samples(processed, advantages[execution_id], layout)
                # shorter rows: less memory a micro-batch, and an execution's branches on several cells
                for piece in (
                    split_long(sample, traj_cfg.max_piece_tokens) if layout == "packed" else [sample]
                )
                if piece.num_loss_tokens
            ]
            samples.extend(pieces)
            training = "trained" if pieces else "no loss tokens"
        elif figures["loss_tokens_selected"]:  # not packed: its gradient is zero
            untrained.append(execution_id)
            training = ZERO_ADVANTAGE
        else:
            training = "no loss tokens"
        stats.append({**figures, "training": training})
    if not samples:
        return [], stats
    batches = micro_batches(
        samples,
        traj_cfg.row_tokens,
        traj_cfg.micro_batch_tokens,
        share_rows=layout == "packed",
        max_row_padding=traj_cfg.max_row_padding,
    )
    if untrained:
        batches[0].meta["untrained_execution_ids"] = untrained
    return batches, stats
