"""With the tiny Qwen3 model: a packed tree gives every selected path the logprobs it has alone, and the
packed GSPO loss has the gradient of the expanded loss in which each duplicated output token counts once."""

from __future__ import annotations

import pytest
import torch

from gyre_ray.algo.advantages import group_advantages
from gyre_ray.algo.gspo import gspo_token_objective, step_scale, tree_gspo_loss
from gyre_ray.model.arch import ModelArgs
from gyre_ray.model.qwen3 import Qwen3ForCausalLM, init_weights
from gyre_ray.trainers.batch import sequential_parent_index, token_logprobs
from gyre_ray.trajectory.batching import micro_batches
from gyre_ray.trajectory.config import TrajectorySection
from gyre_ray.trajectory.packing import pack_paths
from gyre_ray.trajectory.pieces import split_long, split_roots
from gyre_ray.trajectory.pipeline import build_training_batches, process_execution
from gyre_ray.trajectory.synthetic import SyntheticWorkload, synthetic_execution

WORKLOAD = SyntheticWorkload(system_tokens=24, task_tokens=6, subagent_system_tokens=12, tool_tokens=(3, 10),
                             output_tokens=(3, 8), summary_tokens=6, segments=(2, 3), turns=(2, 4),
                             max_subagents=3, retry_prob=0.35)  # fmt: skip
SEEDS = (0, 1, 3)
CLIP = (3e-4, 4e-4)


def model(dtype: torch.dtype) -> Qwen3ForCausalLM:
    # A wide init so that logits depend strongly on context (a wrong mask cannot hide in noise).
    return init_weights(Qwen3ForCausalLM(ModelArgs.tiny(), dtype=dtype), seed=0, std=0.2).eval()


def executions():
    out = []
    for seed in SEEDS:
        records, truth = synthetic_execution(f"e{seed}", seed, WORKLOAD)
        proc = process_execution(records, TrajectorySection(budget=5))
        out.append((proc, truth, records))
    return out


def test_the_trees_have_compactions_sub_agents_and_retries() -> None:
    roles, retries = set(), 0
    for proc, truth, records in executions():
        roles.update(truth)
        prompts = [tuple(r.input_ids) for r in records]
        retries += len(prompts) - len(set(prompts))
        assert len(proc.paths) > 1
    assert {"main", "main-summary", "sub-agent"} <= roles and retries > 0


def path_tokens(path) -> list[int]:
    return [t for n in path.nodes for t in n.tokens]


def solo_logprobs(net, tokens: list[int]) -> torch.Tensor:
    ids = torch.tensor([tokens])
    return token_logprobs(net(ids), ids, sequential_parent_index(1, len(tokens)))[0]


# Shorter than the trees' main contexts: `split_long` cuts below the shared system prompt.
SHORT_PIECES = 40


def packed_batches(procs, pieces: str):
    samples = []
    for proc in procs:
        sample = pack_paths(proc.execution_id, proc.selected, advantage=1.0)
        split = {"whole": lambda s: [s], "roots": split_roots, "long": lambda s: split_long(s, SHORT_PIECES)}
        samples.extend(split[pieces](sample))
    return samples, micro_batches(samples, row_tokens=700, micro_batch_tokens=1400)


@pytest.mark.parametrize(
    ("pieces", "dtype"),
    [("whole", torch.float64), ("roots", torch.float64), ("roots", torch.float32), ("long", torch.float64)],
    ids=["whole-trees-f64", "split-roots-f64", "split-roots-f32", "split-long-f64"],
)
def test_packed_forward_equals_each_selected_path_alone(pieces: str, dtype: torch.dtype) -> None:
    """Every path's log-probs in its packed row are those it has alone, whole trees or cut: a cut
    below a prefix (`split_long`) gives each piece a copy of it as its ancestry."""
    net = model(dtype)
    procs = [p for p, _, _ in executions()]
    samples, batches = packed_batches(procs, pieces)
    assert any(len(b.meta["execution_ids"]) > 1 for b in batches), "rows should hold several trees"
    if pieces == "long":  # cut below a prefix, not only into roots
        assert len(samples) > len(packed_batches(procs, "roots")[0])
        assert any(s.meta.get("prefix_tokens", 0) > 0 for s in samples)
    worst, causal_gap, compared = 0.0, 0.0, 0
    with torch.no_grad():
        for batch in batches:
            lp = token_logprobs(net(batch.input_ids, batch.position_ids, batch.attention_mask),
                                batch.input_ids, batch.parent_index)  # fmt: skip
            plain = token_logprobs(
                net(batch.input_ids, batch.position_ids), batch.input_ids, batch.parent_index
            )
            for r in range(batch.input_ids.shape[0]):
                parent = batch.parent_index[r].tolist()
                for k in range(batch.tensors["path_mask"].shape[1]):
                    cols = batch.tensors["path_mask"][r, k].nonzero().flatten().tolist()
                    if not cols:
                        continue
                    walk = [cols[-1]]  # the path's columns: follow parents up from its last loss token
                    while parent[walk[-1]] >= 0:
                        walk.append(parent[walk[-1]])
                    walk.reverse()
                    tokens = batch.input_ids[r, walk].tolist()
                    alone = solo_logprobs(net, tokens)
                    # float32 rounds differently in a longer row: compare relative to |log p| there.
                    scale = alone.abs().clamp(min=1.0) if dtype == torch.float32 else 1.0
                    worst = max(worst, ((lp[r, walk] - alone).abs() / scale).max().item())
                    causal_gap = max(causal_gap, (plain[r, walk] - alone).abs().max().item())
                    compared += 1
    assert compared == sum(len(p.selected) for p in procs)
    assert worst <= 1e-5, f"packed vs alone differ by {worst}"
    assert causal_gap > 1e-2, "plain causal attention over the packed row must not pass this test"


@pytest.mark.parametrize("max_piece_tokens", [65536, SHORT_PIECES], ids=["default", "cut-long-trees"])
def test_packed_loss_gradient_equals_expanded_loss_with_each_output_token_counted_once(
    max_piece_tokens: int,
) -> None:
    net = model(torch.float64)
    found = executions()
    procs = [p for p, _, _ in found]
    rewards = {p.execution_id: r for p, r in zip(procs, (1.0, 0.0, 0.6), strict=True)}
    groups = dict.fromkeys(rewards, "task")
    advantages = group_advantages(rewards, groups)
    # The whole pipeline: records -> trees -> selection -> packed pieces -> rows -> micro-batches.
    cfg = TrajectorySection(
        budget=5, row_tokens=200, micro_batch_tokens=400, max_piece_tokens=max_piece_tokens
    )
    batches = build_training_batches({p.execution_id: r for p, _, r in found}, rewards, groups, cfg)
    if max_piece_tokens == SHORT_PIECES:  # trees were cut: their prefix copies add columns
        whole = build_training_batches(
            {p.execution_id: r for p, _, r in found}, rewards, groups, TrajectorySection(budget=5)
        )
        assert sum(b.meta["tokens"] for b in batches) > sum(b.meta["tokens"] for b in whole)
    assert len(batches) > 1 and step_scale(batches) == pytest.approx(1 / 3)
    # Behaviour logprobs near the current policy, so some sequences are clipped and some are not.
    g = torch.Generator().manual_seed(7)
    old_of: dict[tuple[str, tuple[int, ...]], float] = {}  # (execution, token prefix) -> pi_old
    with torch.no_grad():
        for b in batches:
            lp = token_logprobs(
                net(b.input_ids, b.position_ids, b.attention_mask), b.input_ids, b.parent_index
            )
            noise = torch.randn(lp.shape, generator=g, dtype=torch.float64) * 2e-3
            b.tensors["old_logprobs"] = torch.where(b.tensors["loss_mask"], lp + noise, 0.0)
            for r in range(lp.shape[0]):
                parent, ids = b.parent_index[r].tolist(), b.input_ids[r].tolist()
                for c in b.tensors["loss_mask"][r].nonzero().flatten().tolist():
                    prefix, j = [], c
                    while j >= 0:
                        prefix.append(ids[j])
                        j = parent[j]
                    owner = b.meta["execution_ids"][
                        b.tensors["path_execution"][r][b.tensors["path_mask"][r, :, c]][0]
                    ]
                    old_of[(owner, tuple(reversed(prefix)))] = b.tensors["old_logprobs"][r, c].item()

    net.zero_grad()
    clipped = []
    for b in batches:
        lp = token_logprobs(net(b.input_ids, b.position_ids, b.attention_mask), b.input_ids, b.parent_index)
        loss, metrics = tree_gspo_loss(lp, b, *CLIP)
        loss.backward()
        clipped.append(metrics["clip_fraction"])
    packed = {n: p.grad.clone() for n, p in net.named_parameters()}
    assert 0 < sum(clipped) / len(clipped) < 1

    # Reference: every selected path on its own row; a loss token shared by n paths gets 1/n of its
    # weight in each, and each execution's distinct loss tokens are averaged.
    net.zero_grad()
    for proc in procs:
        keys_per_path = []
        for path in proc.selected:
            tokens = path_tokens(path)
            loss_flags = [f for n in path.nodes for f in n.loss]
            keys_per_path.append([tuple(tokens[: j + 1]) for j, f in enumerate(loss_flags) if f])
        uses: dict[tuple[int, ...], int] = {}
        for keys in keys_per_path:
            for key in keys:
                uses[key] = uses.get(key, 0) + 1
        total = 0.0
        for path, keys in zip(proc.selected, keys_per_path, strict=True):
            tokens = path_tokens(path)
            lp_all = solo_logprobs(net, tokens)
            lp = torch.stack([lp_all[len(k) - 1] for k in keys])
            old = torch.tensor([old_of[(proc.execution_id, k)] for k in keys], dtype=torch.float64)
            seq_log_ratio = (lp - old).mean()
            adv = torch.tensor(advantages[proc.execution_id], dtype=torch.float64)
            objective = gspo_token_objective(lp, seq_log_ratio, adv, *CLIP)
            weights = torch.tensor([1.0 / (uses[k] * len(uses)) for k in keys], dtype=torch.float64)
            total = total - (weights * objective).sum()
        total.backward()
    for name, p in net.named_parameters():
        ref = p.grad
        assert ref.norm() > 0 or name.endswith("norm.weight")
        rel = (packed[name] - ref).norm() / ref.norm().clamp(min=1e-30)
        assert rel <= 1e-5, f"{name}: relative gradient difference {rel:.2e}"
