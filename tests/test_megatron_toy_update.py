"""The toy job's first update, Megatron vs torch: the toy config's model (tiny preset, tied, 4 layers,
vocab 8192), trainer settings and GSPO loss, on the same tree-packed micro-batches. At the toy's lr
(1e-5) an update is below float32 resolution of the weights, so it is read from the optimizer state
(AdamW's first step is a function of the first and second moments), mapped back to HF names."""

from __future__ import annotations

from pathlib import Path

import torch
from megatron_cases import max_relative_error, packed_batches, require_megatron

from gyre_ray.algo import get_loss
from gyre_ray.algo.gspo import step_scale
from gyre_ray.config import load_config
from gyre_ray.model import load_policy
from gyre_ray.trainers.factory import make_trainer

require_megatron()

from gyre_ray.trainers.megatron.convert import megatron_to_hf  # noqa: E402

ROOT = Path(__file__).resolve().parents[1]


def first_adamw_update(trainer, names: dict, weights: dict) -> dict[str, torch.Tensor]:
    """The step AdamW took from its state after one step, in float64, under the names of `weights`."""
    section = trainer.section
    b1, b2 = section.betas
    moments = {}
    for name, param in names.items():
        state = trainer.optimizer.state[param]
        m, v = state["exp_avg"].double() / (1 - b1), state["exp_avg_sq"].double() / (1 - b2)
        moments[name] = m / (v.sqrt() + section.eps)
    if hasattr(trainer, "spec"):  # Megatron names -> HF names
        moments = megatron_to_hf(moments, trainer.args, trainer.spec)
    return {k: -section.lr * (moments[k] + section.weight_decay * weights[k].double()) for k in weights}


def test_toy_first_update_megatron_equals_torch() -> None:
    cfg = load_config(ROOT / "jobs/configs/toy.yaml", ["trainer.backend=megatron"])
    loss = get_loss(cfg.algo.name, cfg.algo)
    model, _, args = load_policy(cfg.model)
    assert args.tie_word_embeddings and args.num_hidden_layers == 4
    torch_trainer = make_trainer(cfg.trainer.model_copy(update={"backend": "torch"}), model, args, loss)
    megatron = make_trainer(cfg.trainer, load_policy(cfg.model)[0], args, loss)
    weights = torch_trainer.state_dict()
    weights.pop("lm_head.weight")
    batches = packed_batches(torch_trainer)
    for batch in batches:
        torch_trainer.forward_backward(batch)
        megatron.forward_backward(batch)
    grads = torch_trainer.export_grads()
    assert max_relative_error(grads, megatron.export_grads()) < 1e-5
    scale = step_scale(batches)
    m_torch, m_megatron = torch_trainer.optimizer_step(scale), megatron.optimizer_step(scale)
    exact = scale * sum(float(g.double().pow(2).sum()) for g in grads.values()) ** 0.5
    assert abs(m_megatron["grad_norm"] - exact) <= 1e-6 * exact  # float64 sum of squares
    # torch's clip_grad_norm_ reduces in float32: ~7e-5 off here (1.2 M gradient entries); AdamW's
    # first step divides the clip factor out again (m / sqrt(v)), so the update does not see it.
    assert abs(m_torch["grad_norm"] - exact) <= 1e-3 * exact
    update_torch = first_adamw_update(torch_trainer, torch_trainer.params, weights)
    update_megatron = first_adamw_update(megatron, megatron.params, weights)
    # AdamW's first step is ~lr * g / (|g| + eps): where |g| is at float32 rounding level the step is
    # noise in any implementation; compare where the gradient is well above it (the share of the
    # gradient's squared norm there is `covered`).
    live = {k: g.abs() > 1e-3 * float(g.abs().max()) for k, g in grads.items()}
    mass = sum(float(g.double().pow(2).sum()) for g in grads.values())
    covered = sum(float(grads[k].double()[m].pow(2).sum()) for k, m in live.items()) / mass
    worst = max(float((update_torch[k] - update_megatron[k]).abs()[live[k]].max()) for k in live)
    largest = max(float(u.abs().max()) for u in update_torch.values())
    assert worst / largest < 1e-5 and covered > 0.99, (worst / largest, covered)
    after_torch, after_megatron = torch_trainer.state_dict(), megatron.state_dict()
    assert all(torch.allclose(after_torch[k], after_megatron[k], rtol=0, atol=1e-6) for k in after_megatron)
