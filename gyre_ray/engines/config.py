"""Config section `engine`: the rollout engine backend and its limits."""

from __future__ import annotations

from typing import Literal

from pydantic import Field

from gyre_ray.configbase import Section


class SGLangOptions(Section):
    """The SGLang engine (`engine.backend=sglang`): one SGLang server per cell, driven over HTTP."""

    url: str | None = Field(
        None,
        description="Base URL of an SGLang server to use (e.g. http://10.0.0.5:30000); unset: the cell "
        "starts its own server on the GPUs of its bundle and stops it with the cell.",
    )
    api_key_env: str | None = Field(
        None,
        min_length=1,
        description="With url: the environment variable (in the cell's process) holding that server's "
        "--api-key, sent as 'Authorization: Bearer'; unset sends none. A server the cell starts always "
        "gets a fresh random key of its own, which only the cell holds.",
    )
    tp_size: int = Field(
        0, ge=0, description="Tensor-parallel size of the started server; 0 = every GPU of the cell's bundle."
    )
    mem_fraction_static: float = Field(
        0.8,
        gt=0,
        le=1,
        description="Share of GPU memory SGLang takes for weights and KV (--mem-fraction-static).",
    )
    memory_saver: bool = Field(
        True,
        description="Start with --enable-memory-saver so release/resume free and re-take GPU memory "
        "around training.",
    )
    weight_sync: Literal["disk", "tensor"] = Field(
        "disk",
        description="How update_weights(state_dict) reaches the server: 'disk' writes a safetensors folder and "
        "calls /update_weights_from_disk; 'tensor' calls /update_weights_from_tensor (same host only). "
        "NCCL broadcast from the trainer goes through init_weights_group / update_weights_from_distributed.",
    )
    startup_timeout_s: float = Field(
        600.0, gt=0, description="Longest wait for a started server to be healthy."
    )
    request_timeout_s: float = Field(
        3600.0,
        gt=0,
        description="Longest the server may stay silent during one HTTP call (a stream's tokens keep it "
        "alive); past it the call fails naming the cell.",
    )
    connect_timeout_s: float = Field(
        10.0,
        gt=0,
        description="Longest wait to connect to the server; past it the call fails naming the cell.",
    )
    extra_args: list[str] = Field(
        default_factory=list, description="More command-line arguments for sglang.launch_server."
    )


class EngineSection(Section):
    """Rollout engine settings shared by all backends."""

    backend: Literal["torch", "sglang"] = Field("torch", description="Rollout engine backend.")
    max_batch_size: int = Field(16, ge=1, description="Most requests decoded together in one batch.")
    prefix_cache_tokens: int = Field(
        262_144, ge=0, description="Token budget of the prefix (radix) KV cache; 0 disables it."
    )
    prefill_chunk_tokens: int = Field(
        1024,
        ge=1,
        description="Most prompt tokens prefilled per scheduler iteration; longer prompts continue in the "
        "next iteration while running requests keep decoding.",
    )
    torch_threads: int = Field(
        0,
        ge=0,
        description="Torch intra-op threads for the torch engine (process-wide); 0 leaves torch's default.",
    )
    sglang: SGLangOptions = Field(default_factory=SGLangOptions, description="SGLang engine options.")
