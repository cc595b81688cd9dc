"""Config section `model`: which policy model to build or load."""

from __future__ import annotations

from typing import Literal

from pydantic import Field

from gyre_ray.configbase import Section


class ModelSection(Section):
    """Where the policy comes from: a built-in preset with random weights, or a local HF folder."""

    preset: Literal["tiny"] = Field("tiny", description="Built-in architecture used when `path` is unset.")
    path: str | None = Field(
        None,
        description="Local HF model folder (config.json + model.safetensors [+ tokenizer]); overrides preset.",
    )
    seed: int = Field(0, description="Seed for random initialisation of a preset model.")
    dtype: Literal["float32", "bfloat16", "float64"] = Field("float32", description="Parameter dtype.")
