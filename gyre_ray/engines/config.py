"""Config section `engine`: the rollout engine backend and its limits."""

from __future__ import annotations

from typing import Literal

from pydantic import Field

from gyre_ray.configbase import Section


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
