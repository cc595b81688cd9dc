"""The only CPU shims the Megatron-core trainer needs, active only where CUDA is absent.

megatron-core 0.16 assumes a GPU in two places the trainer reaches on CPU (checked on a 2-core
CPU machine, torch 2.13, local layer spec):

1. `torch.cuda.current_device()` is asked for the device of the global memory buffer (attention
   scores) and of tensor-parallel gathers; here it answers "cpu".
2. Attention forks the CUDA RNG tracker around dropout; here the tracker is Megatron's own
   no-op "inference" tracker (`initialize_rng_tracker(inference_rng_tracker=True)`), which is
   exact because the trainer builds Megatron with dropout 0.

The trainer calls its layers directly (one pipeline stage, no `get_forward_backward_func`), so the
pipeline schedules' `device="cuda"` buffers are never touched and need no shim. On a GPU machine
`apply()` does nothing and the RNG tracker is seeded with `model_parallel_cuda_manual_seed`.
"""

from __future__ import annotations

import torch

_applied = False


def cuda_absent() -> bool:
    """True where the shims are needed (no usable CUDA device)."""
    return not torch.cuda.is_available()


def apply(seed: int = 0) -> bool:
    """Install the shims once per process when CUDA is absent; returns whether they are active."""
    global _applied
    from megatron.core.tensor_parallel import random as mp_random

    if not cuda_absent():
        mp_random.model_parallel_cuda_manual_seed(seed)
        return False
    if not _applied:
        torch.cuda.current_device = _cpu_device
        _applied = True
    mp_random.initialize_rng_tracker(inference_rng_tracker=True, force_reset=True)
    return True


def _cpu_device() -> str:
    return "cpu"
