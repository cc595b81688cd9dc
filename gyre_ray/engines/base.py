"""The rollout-engine interface every backend implements (torch on CPU, SGLang on GPU).

Engines take token ids and return token ids with per-token log-probabilities and the policy
version that produced each token. A request can be aborted (its partial output returned),
exported with its KV state and imported into another engine, where it continues without
recomputing its prefix. The proxy and the cell actors only ever talk to this interface.
"""

from __future__ import annotations

import abc
import math
from collections.abc import AsyncIterator
from dataclasses import dataclass, field
from typing import Any, ClassVar, Literal

FinishReason = Literal["stop", "length", "abort"]


class EngineInputError(ValueError):
    """A request the engine refuses (bad ids, empty prompt, over the context, bad sampling values)."""


class UnknownRequestError(KeyError):
    """`export_kv` named a request the engine is not running (unknown, finished or already moved)."""

    def __str__(self) -> str:  # KeyError would print the repr of its argument
        return str(self.args[0]) if self.args else "unknown request"


class EngineClosedError(RuntimeError):
    """The engine was shut down; it accepts no more requests."""


@dataclass
class SamplingParams:
    """How to sample. temperature 0 means greedy."""

    temperature: float = 1.0
    top_p: float = 1.0
    max_new_tokens: int = 256
    stop_token_ids: list[int] = field(default_factory=list)
    seed: int | None = None
    # draws a seeded generator skips first: a call continued on another cell from its recorded output
    # (its lost cell had drawn one number per sampled token) goes on drawing where it stopped
    draws_done: int = 0

    def validate(self) -> None:
        """Raise EngineInputError naming the offending value."""
        if not isinstance(self.temperature, (int, float)) or not math.isfinite(self.temperature):
            raise EngineInputError(f"temperature must be a finite number >= 0, got {self.temperature!r}")
        if self.temperature < 0:
            raise EngineInputError(f"temperature must be >= 0, got {self.temperature}")
        if not math.isfinite(self.top_p) or not 0 < self.top_p <= 1:
            raise EngineInputError(f"top_p must be in (0, 1], got {self.top_p!r}")
        if not isinstance(self.max_new_tokens, int) or self.max_new_tokens < 1:
            raise EngineInputError(f"max_new_tokens must be an integer >= 1, got {self.max_new_tokens!r}")
        if isinstance(self.draws_done, bool) or not isinstance(self.draws_done, int) or self.draws_done < 0:
            raise EngineInputError(f"draws_done must be an integer >= 0, got {self.draws_done!r}")


@dataclass
class GenerateRequest:
    """One generation: a prompt of token ids, a request id unique within the engine, sampling params."""

    rid: str
    input_ids: list[int]
    sampling: SamplingParams = field(default_factory=SamplingParams)


ABORT_TOKEN_ID = -1


@dataclass
class TokenEvent:
    """One streamed token (finish_reason set on the last event of a request).

    A stream that is aborted or exported ends with one event whose finish_reason is "abort" and
    whose token_id is ABORT_TOKEN_ID (-1): it carries no token.
    """

    rid: str
    token_id: int
    logprob: float
    version: int
    finish_reason: FinishReason | None = None
    cached_tokens: int | None = None  # on a request's first token: prompt tokens served from cache


@dataclass
class GenerateResult:
    """What a finished (or aborted) request produced."""

    rid: str
    input_ids: list[int]
    output_ids: list[int]
    output_logprobs: list[float]
    output_versions: list[int]
    finish_reason: FinishReason
    cached_tokens: int = 0  # prompt tokens served from the prefix cache (or an imported KV state)


@dataclass
class KVState:
    """A request's resumable state: tokens so far, its KV tensors (CPU) and its sampling state."""

    rid: str
    input_ids: list[int]
    output_ids: list[int]
    output_logprobs: list[float]
    output_versions: list[int]
    sampling: SamplingParams
    kv: Any  # backend-specific, e.g. per-layer (k, v) CPU tensors covering input_ids + output_ids[:-1]
    rng_state: Any = None
    version: int = 0  # weight version that computed the oldest of these KV entries


@dataclass
class PrefixState:
    """A cached prompt prefix with its KV (a waiting session's cache), moved from one engine to another."""

    tokens: list[int]
    kv: Any  # backend-specific, e.g. per-layer (k, v) CPU tensors covering `tokens`
    version: int = 0  # weight version that computed this KV


class RolloutEngine(abc.ABC):
    """Token-level generation with continuous batching, prefix caching and KV migration.

    `kv_export` declares whether `export_kv` carries the request's KV tensors. An engine without
    (SGLang) returns a state with `kv=None`; `import_kv` of such a state re-prefills prompt + output.

    Optional: `export_prefix` / `import_prefix` move a waiting session's cached prefix between
    engines. A backend that can declares `supports_prefix_export = True`; the defaults export
    nothing and import nothing, so a moved session's next call re-prefills its prompt.
    """

    supports_prefix_export: ClassVar[bool] = False

    async def export_prefix(self, tokens: list[int]) -> PrefixState | None:
        """The longest cached prefix of `tokens` with its KV (None: nothing cached, or not supported)."""
        return None

    async def import_prefix(self, state: PrefixState) -> int:
        """Add another engine's exported prefix to this cache; tokens added (0: unsupported or stale)."""
        return 0

    kv_export: ClassVar[bool] = True

    @abc.abstractmethod
    async def generate(self, request: GenerateRequest) -> GenerateResult:
        """Run the request to completion (or until aborted) and return its result."""

    @abc.abstractmethod
    def stream(self, request: GenerateRequest) -> AsyncIterator[TokenEvent]:
        """Yield tokens as they are generated; the last event carries finish_reason."""

    @abc.abstractmethod
    async def abort(self, rid: str) -> GenerateResult | None:
        """Stop a request; return its partial output (None if unknown or finished)."""

    @abc.abstractmethod
    async def export_kv(self, rid: str) -> KVState:
        """Stop a running request and hand over its resumable state."""

    @abc.abstractmethod
    def import_kv(self, state: KVState) -> AsyncIterator[TokenEvent]:
        """Continue an exported request here without recomputing its prefix; yields its new tokens."""

    @abc.abstractmethod
    async def update_weights(self, state_dict: dict[str, Any], version: int) -> None:
        """Load new weights at a safe point; later tokens carry `version`."""

    @abc.abstractmethod
    async def release_memory(self) -> None:
        """Free weights and caches (the cell is about to train)."""

    @abc.abstractmethod
    async def resume_memory(self) -> None:
        """Re-allocate what release_memory freed."""

    @abc.abstractmethod
    def stats(self) -> dict[str, Any]:
        """Counters: requests, prompt / prefill-computed / prefix-cached / decoded tokens, running, version."""
