"""A Megatron-core step on a GPU against the torch trainer on CPU (GPU only; skipped without CUDA).

Same HF folder (untied, GQA, head_dim != hidden / heads), local layer spec, TF32 off: log-probs of
the tree-packed GSPO micro-batches, their gradients and one AdamW step. `benchmarks/gpu_check.sh`
runs it on a GPU machine. Bounds are looser than on CPU (1e-4): GPU kernels reduce in another order.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

# Skipped without a GPU only: megatron-core is a dev dependency, and a GPU machine without it must fail
# under CI rather than skip (megatron_cases.require_megatron).
pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU"),
]


@pytest.mark.parametrize("attention", ["tree", "dense"])  # tree core attention / Megatron's own
def test_a_megatron_step_on_gpu_matches_the_torch_trainer(tmp_path: Path, attention: str) -> None:
    from megatron_cases import gspo_loss, hf_folder, max_relative_error, packed_batches, require_megatron

    require_megatron()

    from gyre_ray.algo.gspo import step_scale
    from gyre_ray.model.checkpoint import load_hf
    from gyre_ray.trainers.config import TrainerSection
    from gyre_ray.trainers.factory import make_trainer

    torch.backends.cuda.matmul.allow_tf32 = False
    torch.backends.cudnn.allow_tf32 = False
    folder = hf_folder(tmp_path, tied=False)
    cpu_model, args = load_hf(folder)
    gpu_model, _ = load_hf(folder)
    section = dict(lr=1e-2, weight_decay=0.01, grad_clip=1.0)
    cpu = make_trainer(TrainerSection(backend="torch", **section), cpu_model, args, gspo_loss())
    gpu = make_trainer(
        TrainerSection(backend="megatron", megatron_spec="local", megatron_attention=attention, **section),
        gpu_model,
        args,
        gspo_loss(),
    )
    batches = packed_batches(cpu)
    for batch in batches:
        gap = (gpu.compute_logprobs(batch).cpu() - cpu.compute_logprobs(batch)).abs().max().item()
        assert gap < 1e-4, gap
    for batch in batches:
        cpu.forward_backward(batch)
        gpu.forward_backward(batch)
    assert max_relative_error(cpu.export_grads(), gpu.export_grads()) < 1e-4
    metrics = gpu.optimizer_step(step_scale(batches))
    assert torch.isfinite(torch.tensor(metrics["grad_norm"])) and gpu.version == 1
