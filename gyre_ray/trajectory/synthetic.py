"""Synthetic harness-like executions (call records) for tests and `benchmarks/bench_trajectory.py`.

One execution mimics what a coding-agent harness such as Claude Code leaves, scaled down for the
tiny CPU model (its ~80k-token system + tools prompt becomes `system_tokens`):

- a main agent: `segments` main contexts of `turns` calls each; every call's prompt is the
  previous prompt + the previous output + a tool result; a main segment ends with a compaction
  call (prompt = context + summary instruction, role `main-summary`) whose output seeds the next
  segment's fresh context (system prompt + task + summary);
- 0..`max_subagents` sub-agents (uniform), each spawned from a random main turn with its own system
  prompt and a prompt taken from the end of the spawning output; they run `subagent_turns` calls
  and, with probability `subagent_compact_prob`, compact once (`sub-agent-summary`); the
  sub-agent's last output comes back inside the main agent's next tool result;
- retries: with probability `retry_prob` a call is made twice with the same prompt; the first
  attempt is abandoned (a dead sibling branch).

Token ids are random in [16, vocab_size); every quantity comes from one seeded RNG.
"""

from __future__ import annotations

import random
from dataclasses import dataclass

from gyre_ray.trajectory.records import CallRecord


@dataclass
class SyntheticWorkload:
    """Shape of the synthetic executions (defaults: the benchmark's documented default workload)."""

    system_tokens: int = 512
    task_tokens: int = 48
    subagent_system_tokens: int = 256
    segments: tuple[int, int] = (1, 3)  # main contexts per execution (compactions = segments - 1)
    turns: tuple[int, int] = (3, 6)  # main calls per segment
    output_tokens: tuple[int, int] = (16, 64)
    tool_tokens: tuple[int, int] = (32, 128)
    summary_tokens: int = 48
    instruction_tokens: int = 12
    max_subagents: int = 8
    subagent_turns: tuple[int, int] = (2, 4)
    subagent_compact_prob: float = 0.2
    retry_prob: float = 0.15
    vocab_size: int = 8192
    unknown_roles: bool = False  # record every call as `unknown` (to test the classifier)


class _Builder:
    def __init__(self, execution_id: str, w: SyntheticWorkload, rng: random.Random) -> None:
        self.execution_id, self.w, self.rng = execution_id, w, rng
        self.records: list[CallRecord] = []
        self.truth: list[str] = []
        self.clock = 0.0
        self.sub_system: list[int] = []  # the sub-agents' shared system prompt
        self.pending_subagents = 0  # sub-agents still to spawn
        self.spawn_prob = 0.0  # chance that a main turn spawns one

    def tokens(self, n: int) -> list[int]:
        return [self.rng.randrange(16, self.w.vocab_size) for _ in range(n)]

    def span(self, bounds: tuple[int, int]) -> int:
        return self.rng.randint(bounds[0], bounds[1])

    def call(self, role: str, prompt: list[int], out_len: int | None = None) -> list[int]:
        """Record one call (maybe preceded by an abandoned attempt); return its output tokens."""
        attempts = 2 if self.rng.random() < self.w.retry_prob else 1
        for _ in range(attempts):
            output = self.tokens(out_len or self.span(self.w.output_tokens))
            start, self.clock = self.clock, self.clock + 1.0
            self.records.append(
                CallRecord(
                    execution_id=self.execution_id,
                    call_id=f"c{len(self.records)}",
                    role="unknown" if self.w.unknown_roles else role,
                    input_ids=list(prompt),
                    output_ids=output,
                    output_logprobs=[-self.rng.uniform(0.05, 3.0) for _ in output],
                    versions=[0] * len(output),
                    t_start=start,
                    t_end=self.clock - 0.5,
                )
            )
            self.truth.append(role)
        return output

    def agent(
        self, role: str, context: list[int], turns: int, compactions: int, seed: list[int]
    ) -> list[int]:
        """Run one agent (main or sub-agent) with `compactions` context resets; return its last output."""
        out: list[int] = []
        for segment in range(compactions + 1):
            for turn in range(turns):
                out = self.call(role, context)
                context = context + out
                if role == "main" and turn < turns - 1:
                    context = context + self.maybe_subagent(out) + self.tokens(self.span(self.w.tool_tokens))
                elif turn < turns - 1:
                    context = context + self.tokens(self.span(self.w.tool_tokens))
            if segment < compactions:
                summary = self.call(
                    f"{role}-summary", context + self.tokens(self.w.instruction_tokens), self.w.summary_tokens
                )
                context = seed + self.tokens(4) + summary
        return out

    def maybe_subagent(self, spawning_output: list[int]) -> list[int]:
        """Run a pending sub-agent from this main turn; return what it hands back (or nothing)."""
        if self.pending_subagents <= 0 or self.rng.random() > self.spawn_prob:
            return []
        self.pending_subagents -= 1
        prompt = self.sub_system + spawning_output[len(spawning_output) // 2 :]
        compactions = 1 if self.rng.random() < self.w.subagent_compact_prob else 0
        result = self.agent(
            "sub-agent", prompt, self.span(self.w.subagent_turns), compactions, self.sub_system
        )
        return self.tokens(4) + result


def synthetic_execution(
    execution_id: str, seed: int, workload: SyntheticWorkload | None = None
) -> tuple[list[CallRecord], list[str]]:
    """One execution's records and the true role of each call (in record order)."""
    w = workload or SyntheticWorkload()
    rng = random.Random(seed)
    b = _Builder(execution_id, w, rng)
    system, task = b.tokens(w.system_tokens), b.tokens(w.task_tokens)
    b.sub_system = b.tokens(w.subagent_system_tokens)
    segments, turns = b.span(w.segments), b.span(w.turns)
    b.pending_subagents = rng.randint(0, w.max_subagents)
    b.spawn_prob = min(1.0, (b.pending_subagents + 1) / max(1, segments * (turns - 1)))
    b.agent("main", system + task, turns, segments - 1, system + task)
    return b.records, b.truth


def synthetic_executions(
    count: int, seed: int = 0, workload: SyntheticWorkload | None = None
) -> dict[str, list[CallRecord]]:
    """`count` executions keyed `exec-<i>`, each from its own seed."""
    return {
        f"exec-{i}": synthetic_execution(f"exec-{i}", seed * 100_003 + i, workload)[0] for i in range(count)
    }
