"""Per-request bookkeeping of the torch engine, and the bridge that hands its events to asyncio callers.

The engine thread owns every `ActiveRequest`; callers on an asyncio loop read what it produces
through an `EventSink` (a queue fed with `call_soon_threadsafe`). Input validation runs on the
caller's thread so a bad request is refused before it reaches the engine.
"""

from __future__ import annotations

import asyncio
import operator
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

import torch

from gyre_ray.engines.base import EngineInputError, FinishReason, GenerateResult, SamplingParams, TokenEvent
from gyre_ray.model.kv_cache import KVCache

SEED_MIN, SEED_MAX = -(2**63), 2**64 - 1  # what torch.Generator.manual_seed accepts


class EventSink:
    """Where one request's events go: an asyncio queue owned by the caller's loop.

    With `tokens=False` (a caller that only wants the result) token events without a finish
    reason are not delivered, which spares the caller's loop one wake-up per token.
    """

    def __init__(self, rid: str, loop: asyncio.AbstractEventLoop, tokens: bool = True) -> None:
        self.rid = rid
        self.loop = loop
        self.tokens = tokens
        self.queue: asyncio.Queue[Any] = asyncio.Queue()


def _deliver(items: list[tuple[EventSink, Any]]) -> None:
    for sink, item in items:
        sink.queue.put_nowait(item)


class Outbox:
    """Events gathered during one engine iteration, handed to each caller loop in one thread-safe call."""

    def __init__(self) -> None:
        self._pending: dict[asyncio.AbstractEventLoop, list[tuple[EventSink, Any]]] = {}

    def put(self, sink: EventSink, item: Any) -> None:
        if sink.tokens or not isinstance(item, TokenEvent) or item.finish_reason is not None:
            self._pending.setdefault(sink.loop, []).append((sink, item))

    def flush(self) -> set[str]:
        """Deliver everything; return the request ids whose caller loop is gone (they disconnected)."""
        pending, self._pending = self._pending, {}
        gone: set[str] = set()
        for loop, items in pending.items():
            try:
                loop.call_soon_threadsafe(_deliver, items)
            except RuntimeError:
                gone.update(sink.rid for sink, _ in items)
        return gone


@dataclass
class ActiveRequest:
    """A request the engine is working on: its tokens so far, KV while not in a decode batch, RNG."""

    rid: str
    input_ids: list[int]
    sampling: SamplingParams
    generator: torch.Generator
    seed: int
    stop_ids: frozenset[int]
    sink: EventSink
    output_ids: list[int] = field(default_factory=list)
    output_logprobs: list[float] = field(default_factory=list)
    output_versions: list[int] = field(default_factory=list)
    cache: KVCache | None = None  # KV of the first `cache.length` context tokens (prefill phase only)
    cached_tokens: int = 0  # prompt tokens whose KV came from the prefix cache or an import
    prefix_looked_up: bool = False
    kv_version: int | None = None  # weight version of the oldest KV this request holds
    finish_reason: FinishReason | None = None
    final: GenerateResult | None = None  # set by the engine thread before the last event is delivered

    @property
    def context(self) -> list[int]:
        return self.input_ids + self.output_ids

    @property
    def kv_target(self) -> int:
        """Tokens that need KV before the next decode step: all but the pending (last sampled) token."""
        return len(self.input_ids) + len(self.output_ids) - (1 if self.output_ids else 0)

    @property
    def kv_length(self) -> int:
        return 0 if self.cache is None else self.cache.length

    def add_token(self, token: int, logprob: float, version: int) -> TokenEvent:
        """Record a sampled token, decide whether the request is done, and return its event."""
        self.output_ids.append(token)
        self.output_logprobs.append(logprob)
        self.output_versions.append(version)
        if token in self.stop_ids:
            self.finish_reason = "stop"
        elif len(self.output_ids) >= self.sampling.max_new_tokens:
            self.finish_reason = "length"
        return TokenEvent(self.rid, token, logprob, version, self.finish_reason)

    def result(self) -> GenerateResult:
        return GenerateResult(
            rid=self.rid,
            input_ids=list(self.input_ids),
            output_ids=list(self.output_ids),
            output_logprobs=list(self.output_logprobs),
            output_versions=list(self.output_versions),
            finish_reason=self.finish_reason or "abort",
            cached_tokens=self.cached_tokens,
        )


def check_token_ids(ids: Sequence[int], vocab_size: int, what: str) -> list[int]:
    """Plain ints in [0, vocab_size), else EngineInputError naming the first bad position."""
    if not all(type(tok) is int for tok in ids):  # slow path: numpy ints are fine, floats / bools not
        converted = []
        for pos, tok in enumerate(ids):
            try:
                if isinstance(tok, bool):
                    raise TypeError
                converted.append(operator.index(tok))
            except TypeError:
                raise EngineInputError(f"{what}[{pos}] = {tok!r} is not an integer token id") from None
        ids = converted
    ids = list(ids)
    if ids and (min(ids) < 0 or max(ids) >= vocab_size):
        pos = next(i for i, tok in enumerate(ids) if not 0 <= tok < vocab_size)
        raise EngineInputError(
            f"{what}[{pos}] = {ids[pos]} is outside the vocabulary: ids must be in [0, {vocab_size})"
        )
    return ids


def check_request(
    input_ids: Sequence[int], sampling: SamplingParams, vocab_size: int, max_context: int
) -> list[int]:
    """Validate a prompt and its sampling params against the model's limits; return the ids as ints."""
    if not isinstance(sampling, SamplingParams):
        raise EngineInputError(f"sampling must be SamplingParams, got {type(sampling).__name__}")
    sampling.validate()
    if input_ids is None or len(input_ids) == 0:
        raise EngineInputError("the prompt is empty: input_ids must hold at least one token id")
    ids = check_token_ids(input_ids, vocab_size, "input_ids")
    check_token_ids(sampling.stop_token_ids, vocab_size, "stop_token_ids")
    if sampling.seed is not None and (isinstance(sampling.seed, bool) or not isinstance(sampling.seed, int)):
        raise EngineInputError(f"seed must be an integer or None, got {sampling.seed!r}")
    if sampling.seed is not None and not SEED_MIN <= sampling.seed <= SEED_MAX:
        raise EngineInputError(
            f"seed must be in [-2**63, 2**64 - 1] (a torch generator seed), got {sampling.seed}"
        )
    total = len(ids) + sampling.max_new_tokens
    if total > max_context:
        raise EngineInputError(
            f"prompt ({len(ids)} tokens) + max_new_tokens ({sampling.max_new_tokens}) = {total} exceeds "
            f"the model's context length of {max_context} tokens"
        )
    return ids
