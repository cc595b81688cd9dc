"""Megatron-core process groups and a Qwen3-shaped `GPTModel` built from gyre-ray's `ModelArgs`.

`init_parallel` sets up torch.distributed (gloo on CPU, NCCL on GPU; an in-process store when the
world is one process) and Megatron's `parallel_state` for a tensor-parallel size. `build_gpt_model`
makes the decoder the torch model and transformers implement: grouped-query attention with
per-head q/k RMSNorm (`kv_channels` = head_dim, which may differ from hidden / heads), SwiGLU,
RMSNorm, RoPE with the config's base, tied or untied embeddings, no biases, no dropout. The local
layer spec runs everywhere; the Transformer Engine spec is used where TE is importable and CUDA is
present (`spec="auto"`).
"""

from __future__ import annotations

import importlib.util
import warnings
from dataclasses import replace
from typing import Any

import torch
import torch.distributed as dist
import torch.nn.functional as F

from gyre_ray.model.arch import ModelArgs
from gyre_ray.trainers.megatron import cpu_shims

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}

# megatron-core's advice that does not apply to how the trainer uses it (every rank said each, about
# 36 lines a `gyre-ray logprobs --trainer-backend megatron --tp 2`): the fused kernels are optional
# (the local spec runs without them), no CUDA graphs are captured, no async grad all-reduce is used.
for _advice in (
    "Transformer Engine and Apex are not installed",
    "Apex is not installed",
    "full scope is deprecated",
    "When using async grad allreduce",
):
    warnings.filterwarnings("ignore", message=_advice, category=UserWarning, module=r"megatron\.")
warnings.filterwarnings(
    "ignore", message="`torch.distributed.all_gather_into_tensor` is deprecated", category=FutureWarning
)  # megatron-core 0.16's tensor-parallel gathers call it


def resolve_spec(spec: str) -> str:
    """ "local" or "te" for a configured spec ("auto": TE where it is installed and CUDA is present)."""
    if spec == "auto":
        has_te = importlib.util.find_spec("transformer_engine") is not None
        return "te" if has_te and not cpu_shims.cuda_absent() else "local"
    if spec not in ("local", "te"):
        raise ValueError(f"unknown Megatron layer spec {spec!r}; allowed: auto, local, te")
    return spec


def init_parallel(
    tp_size: int,
    *,
    rank: int = 0,
    world_size: int = 1,
    store: dist.Store | None = None,
    cp_size: int = 1,
) -> None:
    """torch.distributed + Megatron `parallel_state` for tensor parallel `tp_size` x context parallel
    `cp_size` (idempotent per process; Megatron's rank order: tensor-parallel rank varies fastest).

    A one-process world uses an in-process store (no port). A larger one needs `store`, e.g. a
    `TCPStore` client of a server on 127.0.0.1 (see `tensor_parallel.py`). Raises RuntimeError if
    this process already runs another layout.
    """
    from megatron.core import parallel_state

    if world_size % (tp_size * cp_size):
        raise ValueError(
            f"world size {world_size} is not a multiple of tensor parallel {tp_size} x context parallel {cp_size}"
        )
    backend = "gloo" if cpu_shims.cuda_absent() else "nccl"
    if not dist.is_initialized():
        if not cpu_shims.cuda_absent():
            torch.cuda.set_device(rank % torch.cuda.device_count())
        if store is None and world_size > 1:
            raise ValueError("init_parallel: a multi-process world needs a store shared by its ranks")
        dist.init_process_group(
            backend, store=store or dist.HashStore(), rank=rank if store else 0, world_size=world_size
        )
    elif dist.get_world_size() != world_size:
        raise RuntimeError(
            f"torch.distributed already runs a world of {dist.get_world_size()} processes here, not {world_size}"
        )
    if parallel_state.model_parallel_is_initialized():
        current = (
            parallel_state.get_tensor_model_parallel_world_size(),
            parallel_state.get_context_parallel_world_size(),
        )
        if current != (tp_size, cp_size):
            raise RuntimeError(
                f"this process already runs Megatron with tensor x context parallel {current[0]} x "
                f"{current[1]}, not {tp_size} x {cp_size}"
            )
    else:
        parallel_state.initialize_model_parallel(
            tensor_model_parallel_size=tp_size, context_parallel_size=cp_size
        )
    cpu_shims.apply()


def transformer_config(args: ModelArgs, tp_size: int, dtype: torch.dtype) -> Any:
    """Megatron `TransformerConfig` for a Qwen3 model (fusions off on CPU, where they do not exist)."""
    from megatron.core.transformer.transformer_config import TransformerConfig

    on_cpu = cpu_shims.cuda_absent()
    return TransformerConfig(
        num_layers=args.num_hidden_layers,
        hidden_size=args.hidden_size,
        num_attention_heads=args.num_attention_heads,
        num_query_groups=args.num_key_value_heads,
        kv_channels=args.head_dim,
        ffn_hidden_size=args.intermediate_size,
        qk_layernorm=True,
        gated_linear_unit=True,
        activation_func=F.silu,
        normalization="RMSNorm",
        layernorm_epsilon=args.rms_norm_eps,
        add_bias_linear=False,
        add_qkv_bias=False,
        attention_dropout=0.0,
        hidden_dropout=0.0,
        tensor_model_parallel_size=tp_size,
        params_dtype=dtype,
        bf16=dtype == torch.bfloat16,
        fp16=dtype == torch.float16,
        use_cpu_initialization=on_cpu,
        perform_initialization=False,  # every weight is loaded from HF tensors right after
        masked_softmax_fusion=not on_cpu,
        bias_activation_fusion=False,
        bias_dropout_fusion=False,
        apply_rope_fusion=False,  # RoPE is applied from explicit position ids (see trainer.py)
        gradient_accumulation_fusion=False,
        persist_layer_norm=False,
    )


def layer_spec(spec: str, attention: str = "tree") -> Any:
    """The decoder layer spec: Megatron's own modules ("local") or Transformer Engine's ("te"); with
    `attention="tree"` its core attention is gyre-ray's planned attention (`tree_core.py`)."""
    from megatron.core.models.gpt import gpt_layer_specs

    if spec == "te":
        layer = gpt_layer_specs.get_gpt_layer_with_transformer_engine_spec(qk_layernorm=True)
    else:
        layer = gpt_layer_specs.get_gpt_layer_local_spec(qk_layernorm=True, normalization="RMSNorm")
    if attention == "tree":
        from gyre_ray.trainers.megatron.tree_core import TreeCoreAttention

        attn = layer.submodules.self_attention  # fresh copies: specs may share their parts
        attn = replace(attn, submodules=replace(attn.submodules, core_attention=TreeCoreAttention))
        layer = replace(layer, submodules=replace(layer.submodules, self_attention=attn))
    elif attention != "dense":
        raise ValueError(f"unknown Megatron attention {attention!r}; allowed: tree, dense")
    return layer


def build_gpt_model(args: ModelArgs, spec: str, dtype: torch.dtype, attention: str = "tree") -> Any:
    """A `GPTModel` with uninitialised weights (this rank's shards); `init_parallel` must have run."""
    from megatron.core import parallel_state
    from megatron.core.models.gpt import GPTModel

    tp_size = parallel_state.get_tensor_model_parallel_world_size()
    check_divisible(args, tp_size)
    model = GPTModel(
        config=transformer_config(args, tp_size, dtype),
        transformer_layer_spec=layer_spec(spec, attention),
        vocab_size=args.vocab_size,
        max_sequence_length=args.max_position_embeddings,
        position_embedding_type="rope",
        rotary_base=args.rope_theta,
        share_embeddings_and_output_weights=args.tie_word_embeddings,
        pre_process=True,
        post_process=True,
    )
    if not cpu_shims.cuda_absent():
        model = model.cuda()
    return model


def check_divisible(args: ModelArgs, tp_size: int) -> None:
    """Raise ValueError naming the field that does not split `tp_size` ways."""
    for name in ("num_attention_heads", "num_key_value_heads", "intermediate_size", "vocab_size"):
        if getattr(args, name) % tp_size:
            raise ValueError(
                f"tensor parallel size {tp_size} does not divide ModelArgs.{name}={getattr(args, name)}"
            )
