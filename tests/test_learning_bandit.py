"""A bandit through the real training pipeline: a sign or scaling error anywhere in the loop fails it.

Each update samples a group of executions from the current policy (a small random Qwen3). An
execution makes two model calls, the second's prompt extending the first's (prompt, answer, tool
output, question again), so its records form a prefix tree with a shared prefix. The reward is the
share of its two answer tokens that fall in a small target set. Records -> tree -> role budget ->
packed sample -> micro-batch -> tree GSPO loss -> gradient scaled by 1 / executions -> AdamW step:
the probability of the target set must rise from its initial value to > 0.5 within a stated number
of updates, and fall when the reward is negated. AdamW hides the gradient's scale, so a third test
compares one update's accumulated, scaled gradient with the policy gradient computed by hand.
"""

from __future__ import annotations

import torch

from gyre_ray.algo.config import AlgoSection
from gyre_ray.algo.gspo import make_tree_gspo_loss, step_scale
from gyre_ray.engines.testing import small_args, small_model
from gyre_ray.trainers.config import TrainerSection
from gyre_ray.trainers.torch_trainer import TorchTrainer
from gyre_ray.trajectory.config import TrajectorySection
from gyre_ray.trajectory.pipeline import build_training_batches
from gyre_ray.trajectory.records import CallRecord

VOCAB = 64
TARGETS = (5, 17, 29, 41)  # 4 of 64 tokens
PROMPT = [3, 9, 12, 7, 22, 31]
TOOL_OUTPUT = [44, 45, 46]
GROUP = 16
UPDATES = 10  # the stated budget: target probability > 0.5 within this many updates


def _target_probability(model: torch.nn.Module, prompt: list[int]) -> float:
    with torch.no_grad():
        logits = model(torch.tensor([prompt]))[0, -1]
    return float(torch.softmax(logits.float(), -1)[list(TARGETS)].sum())


def _sample(model: torch.nn.Module, prompt: list[int], gen: torch.Generator) -> tuple[int, float]:
    with torch.no_grad():
        logits = model(torch.tensor([prompt]))[0, -1].float()
    logp = torch.log_softmax(logits, -1)
    token = int(torch.multinomial(logp.exp(), 1, generator=gen))
    return token, float(logp[token])


def _execution(model: torch.nn.Module, name: str, version: int, gen: torch.Generator) -> list[CallRecord]:
    """Two main calls; the second's prompt extends the first's (a two-node prefix tree)."""
    first, lp1 = _sample(model, PROMPT, gen)
    second_prompt = [*PROMPT, first, *TOOL_OUTPUT, *PROMPT[-2:]]
    second, lp2 = _sample(model, second_prompt, gen)
    return [
        CallRecord(name, "c0", "main", list(PROMPT), [first], [lp1], [version], 0.0, 1.0),
        CallRecord(name, "c1", "main", second_prompt, [second], [lp2], [version], 1.0, 2.0),
    ]


def _setup(seed: int) -> tuple[torch.nn.Module, TorchTrainer, torch.Generator]:
    torch.manual_seed(seed)
    model = small_model(seed, small_args(vocab_size=VOCAB, context=64)).float()
    trainer = TorchTrainer(model, model.args, TrainerSection(lr=3e-3), make_tree_gspo_loss(AlgoSection()))
    return model, trainer, torch.Generator().manual_seed(seed)


def _group(
    model: torch.nn.Module, version: int, sign: float, gen: torch.Generator
) -> tuple[dict[str, list[CallRecord]], dict[str, float]]:
    """One group of executions sampled from `model`, rewarded by sign * share of target answers."""
    model.eval()
    records, rewards = {}, {}
    for i in range(GROUP):
        name = f"u{version}-e{i}"
        records[name] = _execution(model, name, version, gen)
        answers = [r.output_ids[0] for r in records[name]]
        rewards[name] = sign * sum(a in TARGETS for a in answers) / len(answers)
    return records, rewards


def _batches(records: dict[str, list[CallRecord]], rewards: dict[str, float]) -> list:
    groups = dict.fromkeys(records, "bandit")
    return build_training_batches(records, rewards, groups, TrajectorySection(), vocab_size=VOCAB)


def _train(sign: float, seed: int = 0) -> list[float]:
    """Target probability before each update and after the last, training on reward * sign."""
    model, trainer, gen = _setup(seed)
    history = [_target_probability(model, PROMPT)]
    for version in range(UPDATES):
        batches = _batches(*_group(model, version, sign, gen))
        if batches:  # an all-equal group has zero advantages and yields no loss tokens worth a step
            for batch in batches:
                trainer.forward_backward(batch)
            trainer.optimizer_step(step_scale(batches))
        history.append(_target_probability(model, PROMPT))
    return history


def test_bandit_reward_raises_target_probability_above_half() -> None:
    history = _train(sign=1.0)
    start = history[0]
    assert start < 0.25, f"the target set should start unlikely, got p={start:.3f}"
    reached = next((i for i, p in enumerate(history) if p > 0.5), None)
    assert reached is not None, f"p(target) never exceeded 0.5 in {UPDATES} updates: {history}"
    assert history[-1] > 0.5, f"p(target) fell back: {history}"


def test_negated_reward_lowers_target_probability() -> None:
    history = _train(sign=-1.0)
    start, end = history[0], history[-1]
    assert end < start / 2, f"with the reward negated p(target) should fall: {start:.4f} -> {end:.4f}"


def test_pipeline_gradient_equals_hand_computed_policy_gradient() -> None:
    """On-policy GSPO gradient = -(1/N) sum_i A_i * mean over i's answer tokens of grad log p."""
    model, trainer, gen = _setup(seed=1)
    records, _ = _group(model, 0, 1.0, gen)
    # a reward that differs between executions whatever was sampled: the answers' mean token id
    rewards = {n: sum(r.output_ids[0] for r in calls) / (2 * VOCAB) for n, calls in records.items()}
    values = list(rewards.values())
    assert max(values) > min(values)
    mean = sum(values) / len(values)
    std = (sum((v - mean) ** 2 for v in values) / len(values)) ** 0.5
    model.train()
    model.zero_grad(set_to_none=True)
    objective = torch.zeros(())
    for name, calls in records.items():
        advantage = (rewards[name] - mean) / (std + 1e-6)
        token_logps = []
        for call in calls:
            logits = model(torch.tensor([call.input_ids]))[0, -1].float()
            token_logps.append(torch.log_softmax(logits, -1)[call.output_ids[0]])
        objective = objective + advantage * torch.stack(token_logps).mean()
    (-objective / len(records)).backward()
    expected = {n: p.grad.detach().clone() for n, p in model.named_parameters()}
    model.zero_grad(set_to_none=True)

    batches = _batches(records, rewards)
    for batch in batches:
        trainer.forward_backward(batch)
    scale = step_scale(batches)
    assert scale == 1.0 / GROUP
    got = trainer.export_grads()
    for name, grad in expected.items():
        scaled = got[name] * scale
        err = float((scaled - grad).norm() / grad.norm().clamp(min=1e-12))
        assert err < 1e-4, f"{name}: pipeline gradient differs from the hand-computed one by {err:.2e}"
