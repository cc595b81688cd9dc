"""GSPO: `gspo_loss` against a plain-loop reference of the paper's maths (value and gradient), the
GSPO-token form, the tree loss on packed samples, and per-execution normalisation."""

from __future__ import annotations

import inspect
import math

import pytest
import torch

from gyre_ray.algo import get_loss
from gyre_ray.algo.config import AlgoSection
from gyre_ray.algo.gspo import gspo_loss, gspo_token_objective, tree_gspo_loss
from gyre_ray.trajectory.batching import micro_batches
from gyre_ray.trajectory.config import TrajectorySection
from gyre_ray.trajectory.packing import expand_paths
from gyre_ray.trajectory.pipeline import build_training_batches, process_execution
from gyre_ray.trajectory.records import CallRecord
from gyre_ray.trajectory.synthetic import SyntheticWorkload, synthetic_execution


def reference(lp, old, adv, mask, lo, hi):
    """Loss and d loss / d log_probs from the GSPO definitions, one number at a time.

    s_i = exp(mean_t (lp - old)); per token J_t = min(s_i A_t, clip(s_i, 1-lo, 1+hi) A_t) with the
    GSPO-token gradient dJ_t/dlp_t = s_i A_t where the unclipped term is the minimum, else 0;
    loss = -mean over rows with tokens of (mean over the row's tokens of J_t).
    """
    b, t = len(lp), len(lp[0])
    live = [i for i in range(b) if any(mask[i])]
    grad = [[0.0] * t for _ in range(b)]
    total = 0.0
    for i in live:
        cols = [j for j in range(t) if mask[i][j]]
        s = math.exp(sum(lp[i][j] - old[i][j] for j in cols) / len(cols))
        row = 0.0
        for j in cols:
            a = adv[i][j] if isinstance(adv[i], list) else adv[i]
            unclipped, clipped = s * a, min(max(s, 1 - lo), 1 + hi) * a
            row += min(unclipped, clipped)
            if unclipped <= clipped:
                grad[i][j] = -s * a / len(cols) / len(live)
        total += row / len(cols)
    return -total / len(live), grad


def random_case(seed: int, b: int = 6, t: int = 9, spread: float = 3e-4):
    g = torch.Generator().manual_seed(seed)
    old = -torch.rand(b, t, generator=g, dtype=torch.float64) * 3
    lp = old + torch.randn(b, t, generator=g, dtype=torch.float64) * spread
    mask = torch.rand(b, t, generator=g) < 0.7
    mask[:, 0] = True
    adv = torch.randn(b, generator=g, dtype=torch.float64)
    return lp, old, adv, mask


def test_default_clip_ranges_are_the_issue_values() -> None:
    params = inspect.signature(gspo_loss).parameters
    assert params["clip_low"].default == 3e-4 and params["clip_high"].default == 4e-4
    assert (AlgoSection().clip_low, AlgoSection().clip_high) == (3e-4, 4e-4)


@pytest.mark.parametrize("seed", range(8))
def test_gspo_loss_matches_loop_reference_in_value_and_gradient(seed: int) -> None:
    lp, old, adv, mask = random_case(seed)
    lp.requires_grad_(True)
    loss, metrics = gspo_loss(lp, old, adv, mask)
    loss.backward()
    ref_loss, ref_grad = reference(lp.tolist(), old.tolist(), adv.tolist(), mask.tolist(), 3e-4, 4e-4)
    assert loss.item() == pytest.approx(ref_loss, rel=1e-12, abs=1e-15)
    assert torch.allclose(lp.grad, torch.tensor(ref_grad, dtype=torch.float64), rtol=1e-10, atol=1e-15)
    ratios = [
        math.exp(((lp[i] - old[i])[mask[i]]).mean().item()) for i in range(len(lp))
    ]  # the clip fraction counts sequences outside [1 - eps_low, 1 + eps_high]
    assert metrics["clip_fraction"] == pytest.approx(
        sum(not 1 - 3e-4 <= r <= 1 + 4e-4 for r in ratios) / len(ratios)
    )


def test_cases_exercise_both_clipped_and_unclipped_sequences() -> None:
    seen = set()
    for seed in range(8):
        lp, old, adv, mask = random_case(seed)
        _, grad = reference(lp.tolist(), old.tolist(), adv.tolist(), mask.tolist(), 3e-4, 4e-4)
        seen.update(any(g != 0 for g in row) for row in grad)
    assert seen == {True, False}


def test_per_token_advantages_match_the_reference() -> None:
    lp, old, _, mask = random_case(11)
    adv = torch.randn(lp.shape, dtype=torch.float64, generator=torch.Generator().manual_seed(3))
    lp.requires_grad_(True)
    loss, _ = gspo_loss(lp, old, adv, mask, clip_low=0.2, clip_high=0.3)
    loss.backward()
    ref_loss, ref_grad = reference(lp.tolist(), old.tolist(), adv.tolist(), mask.tolist(), 0.2, 0.3)
    assert loss.item() == pytest.approx(ref_loss, rel=1e-12)
    assert torch.allclose(lp.grad, torch.tensor(ref_grad, dtype=torch.float64), rtol=1e-10, atol=1e-15)
    # A (B, T) advantage constant along each row is the same as a (B,) advantage.
    row_adv = adv[:, 0]
    a, _ = gspo_loss(lp, old, row_adv, mask)
    b, _ = gspo_loss(lp, old, row_adv[:, None].expand_as(lp).clone(), mask)
    assert a.item() == pytest.approx(b.item(), rel=1e-14)


@pytest.mark.parametrize("seed", range(4))
def test_token_form_equals_sequence_level_gspo(seed: int) -> None:
    """With one advantage per sequence, GSPO-token has GSPO's value and gradient (paper, sec. 4.3)."""
    lp, old, adv, mask = random_case(seed, spread=2e-3)
    lp.requires_grad_(True)
    loss, _ = gspo_loss(lp, old, adv, mask, clip_low=1e-3, clip_high=1.5e-3)
    (grad_token,) = torch.autograd.grad(loss, lp)
    m = mask.double()
    s = torch.exp(((lp - old) * m).sum(-1) / m.sum(-1))  # gradient flows through s_i itself
    seq_objective = torch.minimum(s * adv, torch.clamp(s, 1 - 1e-3, 1 + 1.5e-3) * adv)
    (grad_seq,) = torch.autograd.grad(-seq_objective.mean(), lp)
    assert loss.item() == pytest.approx(-seq_objective.mean().item(), rel=1e-12)
    assert torch.allclose(grad_token, grad_seq, rtol=1e-10, atol=1e-15)


def test_token_ratio_has_the_sequence_value_and_the_token_gradient() -> None:
    lp = torch.tensor([[-1.0, -2.0, -0.5]], dtype=torch.float64, requires_grad=True)
    seq_log_ratio = torch.tensor([[0.1]], dtype=torch.float64)
    objective = gspo_token_objective(lp, seq_log_ratio, torch.ones(1, 1, dtype=torch.float64), 10.0, 10.0)
    assert torch.allclose(objective, torch.full((1, 3), math.exp(0.1), dtype=torch.float64))
    objective[0, 1].backward()
    assert lp.grad.tolist() == [[0.0, pytest.approx(math.exp(0.1)), 0.0]]  # s_i * grad log pi(y_t)


def test_rows_without_loss_tokens_are_left_out_and_shapes_are_checked() -> None:
    lp, old, adv, mask = random_case(5)
    empty = torch.zeros(1, lp.shape[1], dtype=torch.bool)
    with_empty, _ = gspo_loss(torch.cat([lp, lp[:1]]), torch.cat([old, old[:1]]), torch.cat([adv, adv[:1]]),
                              torch.cat([mask, empty]))  # fmt: skip
    assert with_empty.item() == pytest.approx(gspo_loss(lp, old, adv, mask)[0].item(), rel=1e-14)
    with pytest.raises(ValueError, match="must share one \\(B, T\\) shape"):
        gspo_loss(lp, old[:, :3], adv, mask)
    with pytest.raises(ValueError, match="advantages must be \\(B,\\) or \\(B, T\\)"):
        gspo_loss(lp, old, adv[:2], mask)


SMALL = SyntheticWorkload(system_tokens=12, task_tokens=4, subagent_system_tokens=6, tool_tokens=(2, 5),
                          output_tokens=(2, 5), summary_tokens=4, turns=(2, 3), max_subagents=2)  # fmt: skip


def test_tree_loss_on_one_row_per_path_with_per_path_weights_is_gspo_loss() -> None:
    """The tree loss uses the same maths: rows = paths, weights = row token means averaged over rows."""
    records, _ = synthetic_execution("e", 4, SMALL)
    proc = process_execution(records, TrajectorySection(budget=4))
    rows = expand_paths("e", proc.selected, advantage=0.7, weights="per_path")
    (batch,) = micro_batches(rows, 4096, 1 << 20, share_rows=False)
    g = torch.Generator().manual_seed(0)
    old = batch.tensors["old_logprobs"].double()
    lp = (old + torch.randn(old.shape, generator=g, dtype=torch.float64) * 3e-4).requires_grad_(True)
    tree, _ = tree_gspo_loss(lp, batch)
    (tree_grad,) = torch.autograd.grad(tree, lp)
    adv = batch.tensors["path_advantages"][:, 0].double()
    plain, _ = gspo_loss(lp, old, adv, batch.tensors["loss_mask"])
    (plain_grad,) = torch.autograd.grad(plain, lp)
    assert tree.item() == pytest.approx(plain.item(), rel=1e-6)
    assert torch.allclose(tree_grad, plain_grad, rtol=1e-6, atol=1e-12)
    assert get_loss("gspo")(lp, batch)[0].item() == pytest.approx(tree.item(), rel=1e-12)
    with pytest.raises(KeyError, match="unknown loss 'ppo'; registered: gspo"):
        get_loss("ppo")


def duplicated(records: list[CallRecord]) -> list[CallRecord]:
    """Every token of the execution twice in a row (prompt and output alike)."""
    twice = lambda xs: [x for x in xs for _ in range(2)]  # noqa: E731
    return [
        CallRecord(
            r.execution_id,
            r.call_id,
            r.role,
            twice(r.input_ids),
            twice(r.output_ids),
            twice(r.output_logprobs),
            twice(r.versions),
            r.t_start,
            r.t_end,
        )  # fmt: skip
        for r in records
    ]


def test_duplicating_every_token_of_an_execution_does_not_change_its_weight() -> None:
    short, _ = synthetic_execution("short", 1, SMALL)
    long, _ = synthetic_execution("long", 2, SMALL)
    rewards, groups = {"short": 1.0, "long": 0.0}, {"short": "g", "long": "g"}
    vocab = 8192
    old = torch.zeros(vocab, dtype=torch.float64)
    for r in short + long:
        old[r.output_ids] = torch.tensor(r.output_logprobs, dtype=torch.float64)

    def loss_and_grad(executions, token_mean: bool):
        theta = (old + 2e-4 * torch.sin(torch.arange(vocab, dtype=torch.float64))).requires_grad_(True)
        batches = build_training_batches(executions, rewards, groups, TrajectorySection(budget=3))
        total = 0.0
        for b in batches:
            lp = theta[b.input_ids]  # log pi of a token depends only on its id: duplicates are twins
            if token_mean:  # the alternative normalisation: one mean over all tokens of all executions
                m = b.tensors["path_mask"]
                n_all = sum(bb.tensors["path_mask"].sum() for bb in batches)
                obj = gspo_token_objective(lp[:, None, :], torch.zeros(m.shape[:2], dtype=torch.float64)[..., None],
                                           b.tensors["path_advantages"][..., None].double(), 3e-4, 4e-4)  # fmt: skip
                total = total - (obj * m).sum() / n_all
            else:
                total = total + tree_gspo_loss(lp, b)[0]
        (grad,) = torch.autograd.grad(total, theta)
        return total.item(), grad

    base = loss_and_grad({"short": short, "long": long}, token_mean=False)
    dup = loss_and_grad({"short": short, "long": duplicated(long)}, token_mean=False)
    assert dup[0] == pytest.approx(base[0], rel=1e-9)
    assert torch.allclose(dup[1], base[1], rtol=1e-9, atol=1e-14)
    assert base[1].abs().sum() > 0
    # A token-mean over all executions would let the duplicated execution count twice as much.
    tok_base = loss_and_grad({"short": short, "long": long}, token_mean=True)
    tok_dup = loss_and_grad({"short": short, "long": duplicated(long)}, token_mean=True)
    assert not torch.allclose(tok_dup[1], tok_base[1], rtol=1e-3)
