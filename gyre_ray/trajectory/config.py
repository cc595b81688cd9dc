"""Config section `trajectory`: how an execution's call tree becomes a training sample."""

from __future__ import annotations

from typing import Literal

from pydantic import Field, model_validator

from gyre_ray.configbase import Section

# System-prompt / instruction phrases that mark a call's role when its record says `unknown`.
# Claude Code (observed 2.1.x): sub-agents (the Agent/Task tool) and compaction use their own prompts.
# The toy agent (gyre_ray/agents/toy_agent.py) uses the last two of each list.
DEFAULT_SUMMARY_MARKERS = (
    "Your task is to create a detailed summary of the conversation so far",
    "You are a helpful AI assistant tasked with summarizing conversations",
    "Summarize the conversation so far",
    "summarize the conversation",
)
DEFAULT_SUBAGENT_MARKERS = (
    "You are an agent for Claude Code",
    "You are a sub-agent",
    "You are a subagent",
)


class TrajectorySection(Section):
    """Path budget and selection order, role classification, and micro-batch packing."""

    budget: int = Field(5, ge=1, description="Most root-to-leaf paths kept per execution.")
    tie_break: Literal["longest", "latest", "earliest"] = Field(
        "longest",
        description="Order among paths of equal role priority: most model-generated tokens first, "
        "latest-ending first, or earliest-starting first.",
    )
    summary_markers: list[str] = Field(
        default_factory=lambda: list(DEFAULT_SUMMARY_MARKERS),
        description="Phrases (case-insensitive) in a call's prompt that make an `unknown` call a summary "
        "(compaction) call; needs a decoder.",
    )
    subagent_markers: list[str] = Field(
        default_factory=lambda: list(DEFAULT_SUBAGENT_MARKERS),
        description="Phrases (case-insensitive) in a call's prompt that make an `unknown` call a sub-agent "
        "call; needs a decoder.",
    )
    marker_window_chars: int = Field(
        8000,
        ge=0,
        description="Markers are looked for only in this many characters at each end of the decoded "
        "prompt (system prompt and last instruction), not in tool output in between.",
    )
    min_seed_tokens: int = Field(
        8,
        ge=1,
        description="Shortest output whose tokens, found inside a later new context, count as that "
        "context being seeded by it (compaction summary) for the shape classifier.",
    )
    row_tokens: int = Field(
        1024,
        ge=16,
        description="Packed samples are laid side by side in rows of at most this many tokens "
        "(a sample longer than this gets a row of its own).",
    )
    max_piece_tokens: int = Field(
        65536,
        ge=0,
        description="A packed execution tree longer than this is cut at branch points whose shared "
        "prefix holds no loss token (a system prompt), each piece with its own copy of that prefix, "
        "until each piece fits (docs/trajectory.md, Packing); 0 = never cut (each token computed once).",
    )
    micro_batch_tokens: int = Field(
        8192,
        ge=16,
        description="Most padded tokens (rows x longest row) in one micro-batch; at least one row each.",
    )
    max_row_padding: float = Field(
        0.25,
        ge=0,
        le=1,
        description="A row joins a micro-batch only if at most this fraction of it would be padding "
        "(relative to the micro-batch's longest row).",
    )

    @model_validator(mode="after")
    def _rows_fit_micro_batches(self) -> TrajectorySection:
        if self.micro_batch_tokens < self.row_tokens:
            raise ValueError(
                f"micro_batch_tokens ({self.micro_batch_tokens}) must be >= row_tokens ({self.row_tokens})"
            )
        return self
