"""Config section `warmup`: the supervised pass that runs before RL when `steps` > 0."""

from __future__ import annotations

from pydantic import Field

from gyre_ray.configbase import Section
from gyre_ray.envs.words import WORD_POOL


class WarmupSection(Section):
    """Supervised warm-up on synthetic toy-harness transcripts (gyre_ray.warmup); 0 steps: off."""

    steps: int = Field(
        0, ge=0, description="Optimizer steps of the warm-up (0: RL starts from the model as configured)."
    )
    lr: float = Field(3e-3, gt=0, description="AdamW learning rate of the warm-up.")
    batch_size: int = Field(8, ge=1, description="Transcript calls per warm-up step.")
    words: list[str] = Field(
        default_factory=lambda: list(WORD_POOL),
        min_length=1,
        description="Pool the synthetic replies draw their words from, uniformly (default: the `words` "
        "task set's pool).",
    )
    words_per_reply: int = Field(3, ge=1, description="Words in each synthetic reply.")
    torch_threads: int = Field(
        1,
        ge=0,
        description="Torch intra-op threads of the warm-up (1, like each cell's actor, keeps a shared or busy "
        "machine from thrashing; 0: torch's default).",
    )
    executions: int = Field(
        32,
        ge=1,
        description="Synthetic toy-harness executions rendered into transcripts (in all, cycling over the tasks).",
    )
