"""Config section `trainer`: the trainer backend and optimiser."""

from __future__ import annotations

from typing import Literal

from pydantic import Field, field_validator, model_validator

from gyre_ray.configbase import Section


class TrainerSection(Section):
    """Trainer settings shared by all backends."""

    backend: Literal["torch", "megatron"] = Field("torch", description="Trainer backend.")
    lr: float = Field(
        1e-5, ge=0, description="AdamW learning rate (0: the loop runs, the weights stay; a control run)."
    )
    weight_decay: float = Field(0.0, ge=0, description="AdamW decoupled weight decay.")
    betas: tuple[float, float] = Field((0.9, 0.999), description="AdamW (beta1, beta2), each in [0, 1).")
    eps: float = Field(1e-8, gt=0, description="AdamW epsilon.")
    grad_clip: float = Field(1.0, ge=0, description="Global gradient-norm clip; 0 disables it.")
    tensor_parallel_size: int = Field(
        1,
        ge=1,
        description="Megatron backend: tensor-parallel ranks per trainer replica (gloo on CPU, NCCL on GPU); "
        "must divide heads, KV heads, intermediate size and vocabulary.",
    )
    context_parallel_size: int = Field(
        1,
        ge=1,
        description="Megatron backend: ranks that split each micro-batch's columns (context parallelism: "
        "a long row's activations divided among them; keys and values gathered per layer); "
        "tensor_parallel_size x context_parallel_size ranks per trainer replica.",
    )
    context_parallel_split: Literal["balanced", "zigzag", "contiguous"] = Field(
        "balanced",
        description="Megatron backend, context parallel: which columns each rank takes: balanced (the row "
        "cut into 2-8 equal chunks per rank, dealt out by their attention work so every rank has about "
        "the same), zigzag (2 x ranks chunks, rank r taking chunks r and 2 x ranks - 1 - r: even on "
        "causal rows) or contiguous (one run of columns each).",
    )
    tensor_parallel_workers: Literal["auto", "ray", "process"] = Field(
        "auto",
        description="Megatron backend, more than one rank (tensor x context parallel): where the ranks run: 'ray' (one Ray actor per rank "
        "in the caller's placement group), 'process' (spawned child processes), 'auto' (ray inside a Ray "
        "worker such as a cell actor, else process).",
    )
    megatron_spec: Literal["auto", "local", "te"] = Field(
        "auto",
        description="Megatron backend layer spec: local (Megatron's own modules, runs on CPU), te "
        "(Transformer Engine), auto (te where it is installed and CUDA is present).",
    )
    megatron_attention: Literal["tree", "dense"] = Field(
        "tree",
        description="Megatron backend core attention: tree (gyre-ray's attention planned from the "
        "micro-batch's tree segments: memory linear in the row, docs/megatron.md) or dense (the spec's own "
        "attention over a dense [B, 1, T, T] mask: T^2 bytes a row).",
    )

    @property
    def megatron_ranks(self) -> int:
        """Processes one Megatron trainer replica runs on: tensor parallel x context parallel."""
        return self.tensor_parallel_size * self.context_parallel_size

    @field_validator("betas")
    @classmethod
    def _betas_in_range(cls, betas: tuple[float, float]) -> tuple[float, float]:
        if not all(0.0 <= beta < 1.0 for beta in betas):
            raise ValueError("each AdamW beta must be in [0, 1)")
        return betas

    @model_validator(mode="after")
    def _context_parallel_needs_megatron(self) -> TrainerSection:
        if self.tensor_parallel_size > 1 and self.backend != "megatron":
            raise ValueError(
                f"trainer.tensor_parallel_size={self.tensor_parallel_size} needs trainer.backend=megatron "
                f"(got {self.backend!r}: the torch trainer is one process)"
            )
        if self.context_parallel_size > 1 and self.backend != "megatron":
            raise ValueError(
                f"trainer.context_parallel_size={self.context_parallel_size} needs trainer.backend=megatron "
                f"(got {self.backend!r})"
            )
        if self.context_parallel_size > 1 and self.megatron_attention != "tree":
            raise ValueError("trainer.context_parallel_size > 1 needs trainer.megatron_attention=tree")
        return self
