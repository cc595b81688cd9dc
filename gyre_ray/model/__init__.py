"""The policy model: Qwen3 architecture, KV cache, checkpoints, tokenizer and chat template.

`load_policy(section)` is the one entry point the engines and trainers need: a preset with seeded
random weights, or a local HF folder (with its own tokenizer when it ships one). Names are imported
lazily so that reading the config tree (which imports `gyre_ray.model.config`) does not load torch.
"""

from __future__ import annotations

import importlib
from pathlib import Path
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from gyre_ray.model.arch import ModelArgs
    from gyre_ray.model.config import ModelSection
    from gyre_ray.model.qwen3 import Qwen3ForCausalLM
    from gyre_ray.model.tokenizer import Tokenizer

_LAZY = {
    "ModelArgs": "gyre_ray.model.arch",
    "KVCache": "gyre_ray.model.kv_cache",
    "Qwen3ForCausalLM": "gyre_ray.model.qwen3",
    "init_weights": "gyre_ray.model.qwen3",
    "save_hf": "gyre_ray.model.checkpoint",
    "load_hf": "gyre_ray.model.checkpoint",
    "Tokenizer": "gyre_ray.model.tokenizer",
}
__all__ = [*_LAZY, "load_policy", "load_tokenizer_and_args"]


def __getattr__(name: str) -> Any:
    if name in _LAZY:
        return getattr(importlib.import_module(_LAZY[name]), name)
    raise AttributeError(f"module 'gyre_ray.model' has no attribute {name!r}")


def load_tokenizer_and_args(section: ModelSection) -> tuple[Tokenizer, ModelArgs]:
    """The policy's tokenizer and hyper-parameters without building its weights (for drivers and proxies)."""
    from gyre_ray.model.arch import ModelArgs
    from gyre_ray.model.checkpoint import read_hf_config
    from gyre_ray.model.tokenizer import TOKENIZER_FILE, Tokenizer

    if section.path:
        folder = Path(section.path)
        args = read_hf_config(folder)
        tokenizer = (
            Tokenizer.from_folder(folder) if (folder / TOKENIZER_FILE).is_file() else Tokenizer.default()
        )
    else:
        args = ModelArgs.preset(section.preset)
        args.torch_dtype = section.dtype
        tokenizer = Tokenizer.default()
    if tokenizer.vocab_size > args.vocab_size:
        raise ValueError(
            f"tokenizer {tokenizer.name!r} has {tokenizer.vocab_size} ids but the model's vocab_size is "
            f"{args.vocab_size}; use a tokenizer that fits the model"
        )
    return tokenizer, args


def load_policy(section: ModelSection) -> tuple[Qwen3ForCausalLM, Tokenizer, ModelArgs]:
    """Build the policy described by the `model` config section (in eval mode)."""
    from gyre_ray.model.checkpoint import dtype_from_name, load_hf
    from gyre_ray.model.qwen3 import Qwen3ForCausalLM, init_weights

    tokenizer, args = load_tokenizer_and_args(section)
    dtype = dtype_from_name(section.dtype)
    if section.path:
        model, args = load_hf(section.path, dtype=dtype)
    else:
        model = init_weights(Qwen3ForCausalLM(args, dtype=dtype), section.seed).eval()
    return model, tokenizer, args
