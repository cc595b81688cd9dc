"""A model-free rollout engine with scripted, deterministic outputs: for tests and overhead benchmarks.

`ScriptedEngine` implements the full `RolloutEngine` contract (stream, abort, KV export / import,
stats) without a network: each next token is a pure function of the context, so a request moved
between engines mid-generation produces exactly what it would have produced in place. Canned
replies (`(trigger_ids, reply_ids)`: the reply to a prompt whose *latest* trigger is that one)
let tests script tool calls with real token ids. Delays per prompt token and per output token
emulate an engine's time cost; the time it spends is reported as `busy_seconds` in `stats()`, counters named as the torch engine's.
"""

from __future__ import annotations

import asyncio
import time
import zlib
from collections.abc import AsyncIterator
from dataclasses import dataclass, field
from typing import Any

from gyre_ray.engines.base import (
    ABORT_TOKEN_ID,
    EngineInputError,
    GenerateRequest,
    GenerateResult,
    KVState,
    RolloutEngine,
    SamplingParams,
    TokenEvent,
    UnknownRequestError,
)


@dataclass
class _Request:
    rid: str
    input_ids: list[int]
    sampling: SamplingParams
    output_ids: list[int] = field(default_factory=list)
    output_logprobs: list[float] = field(default_factory=list)
    output_versions: list[int] = field(default_factory=list)
    stopped: bool = False
    finish_reason: str | None = None
    cached_tokens: int = 0
    reply: list[int] | None = None


class ScriptedEngine(RolloutEngine):
    """Deterministic token generator with the RolloutEngine interface."""

    def __init__(
        self,
        vocab_size: int = 8192,
        max_context: int = 65536,
        reply_length: int = 12,
        token_range: tuple[int, int] = (300, 4000),
        replies: list[tuple[list[int], list[int]]] | None = None,
        token_delay_s: float = 0.0,
        prefill_delay_per_token_s: float = 0.0,
        version: int = 0,
    ) -> None:
        self.vocab_size = vocab_size
        self.max_context = max_context
        self.reply_length = reply_length
        self.token_range = token_range
        self.replies = [(list(t), list(r)) for t, r in replies or []]
        self.token_delay_s = token_delay_s
        self.prefill_delay_per_token_s = prefill_delay_per_token_s
        self.version = version
        self._running: dict[str, _Request] = {}
        self._counters = {
            "requests": 0,
            "prompt_tokens": 0,
            "prefill_computed_tokens": 0,
            "prefix_cached_tokens": 0,
            "imported_tokens": 0,
            "decode_tokens": 0,
            "imported": 0,
            "exported": 0,
        }
        self._engine_time = 0.0

    # ---- RolloutEngine ------------------------------------------------------------------------------
    async def generate(self, request: GenerateRequest) -> GenerateResult:
        async for _ in self.stream(request):
            pass
        return self._last_result

    async def stream(self, request: GenerateRequest) -> AsyncIterator[TokenEvent]:
        self._check(request)
        req = _Request(request.rid, list(request.input_ids), request.sampling)
        self._counters["requests"] += 1
        self._counters["prompt_tokens"] += len(req.input_ids)
        self._counters["prefill_computed_tokens"] += len(req.input_ids)
        await self._spend(self.prefill_delay_per_token_s * len(req.input_ids))
        async for event in self._decode(req):
            yield event

    async def abort(self, rid: str) -> GenerateResult | None:
        req = self._running.get(rid)
        if req is None:
            return None
        req.stopped = True
        return self._result(req, "abort")

    async def export_kv(self, rid: str) -> KVState:
        req = self._running.get(rid)
        if req is None:
            raise UnknownRequestError(f"request {rid!r} is not running in this engine")
        req.stopped = True
        self._counters["exported"] += 1
        context = len(req.input_ids) + len(req.output_ids)
        return KVState(
            rid=rid,
            input_ids=list(req.input_ids),
            output_ids=list(req.output_ids),
            output_logprobs=list(req.output_logprobs),
            output_versions=list(req.output_versions),
            sampling=req.sampling,
            kv={"scripted_kv_tokens": context - (1 if req.output_ids else 0)},
            version=self.version,
        )

    async def import_kv(self, state: KVState) -> AsyncIterator[TokenEvent]:
        if not isinstance(state.kv, dict) or "scripted_kv_tokens" not in state.kv:
            raise EngineInputError("ScriptedEngine can only import KV states exported by a ScriptedEngine")
        req = _Request(
            state.rid,
            list(state.input_ids),
            state.sampling,
            list(state.output_ids),
            list(state.output_logprobs),
            list(state.output_versions),
        )
        req.cached_tokens = int(state.kv["scripted_kv_tokens"])
        self._counters["imported"] += 1
        self._counters["imported_tokens"] += req.cached_tokens
        if len(req.output_ids) >= req.sampling.max_new_tokens:
            req.finish_reason = "length"
        async for event in self._decode(req):
            yield event

    async def update_weights(self, state_dict: dict[str, Any], version: int) -> None:
        self.version = version

    async def release_memory(self) -> None:
        return None

    async def resume_memory(self) -> None:
        return None

    def stats(self) -> dict[str, Any]:
        return {
            **self._counters,
            "running": len(self._running),
            "version": self.version,
            "busy_seconds": self._engine_time,
        }

    # ---- internals ------------------------------------------------------------------------------------
    def _check(self, request: GenerateRequest) -> None:
        request.sampling.validate()
        ids = request.input_ids
        if not ids:
            raise EngineInputError("the prompt is empty: input_ids must hold at least one token id")
        if any(not isinstance(t, int) or not 0 <= t < self.vocab_size for t in ids):
            raise EngineInputError(f"input_ids must be token ids in [0, {self.vocab_size})")
        if len(ids) + request.sampling.max_new_tokens > self.max_context:
            raise EngineInputError(
                f"prompt ({len(ids)} tokens) + max_new_tokens ({request.sampling.max_new_tokens}) exceeds "
                f"the model's context length of {self.max_context} tokens"
            )
        if request.rid in self._running:
            raise EngineInputError(f"request id {request.rid!r} is already running")

    async def _spend(self, seconds: float) -> None:
        start = time.perf_counter()
        await asyncio.sleep(seconds)
        self._engine_time += time.perf_counter() - start

    async def _decode(self, req: _Request) -> AsyncIterator[TokenEvent]:
        self._running[req.rid] = req
        req.reply = self._canned_reply(req.input_ids)
        try:
            while req.finish_reason is None:
                await self._spend(self.token_delay_s)
                if req.stopped:
                    req.finish_reason = "abort"
                    yield TokenEvent(req.rid, ABORT_TOKEN_ID, 0.0, self.version, "abort")
                    break
                token = self.next_token(req.input_ids, req.output_ids, req.sampling.stop_token_ids, req.reply)
                req.output_ids.append(token)
                req.output_logprobs.append(-0.5 - (token % 7) / 10.0)
                req.output_versions.append(self.version)
                self._counters["decode_tokens"] += 1
                if token in req.sampling.stop_token_ids:
                    req.finish_reason = "stop"
                elif len(req.output_ids) >= req.sampling.max_new_tokens:
                    req.finish_reason = "length"
                yield TokenEvent(req.rid, token, req.output_logprobs[-1], self.version, req.finish_reason)
        finally:
            self._running.pop(req.rid, None)
            self._last_result = self._result(req, req.finish_reason or "abort")

    def next_token(
        self, input_ids: list[int], output_ids: list[int], stop_ids: list[int], reply: list[int] | None
    ) -> int:
        """The deterministic continuation of `input_ids + output_ids` (`reply`: the canned reply, if any)."""
        if reply is not None:
            if len(output_ids) < len(reply):
                return reply[len(output_ids)]
            return stop_ids[0] if stop_ids else reply[-1]
        if len(output_ids) >= self.reply_length and stop_ids:
            return stop_ids[0]
        context = input_ids[-8:] + output_ids[-8:]
        digest = zlib.crc32(repr((len(input_ids) + len(output_ids), context)).encode())
        low, high = self.token_range
        return low + digest % (high - low)

    def _canned_reply(self, input_ids: list[int]) -> list[int] | None:
        best, best_pos = None, -1
        for trigger, reply in self.replies:
            pos = _rfind(input_ids, trigger)
            if pos > best_pos:
                best, best_pos = reply, pos
        return best

    def _result(self, req: _Request, finish: str) -> GenerateResult:
        return GenerateResult(
            rid=req.rid,
            input_ids=list(req.input_ids),
            output_ids=list(req.output_ids),
            output_logprobs=list(req.output_logprobs),
            output_versions=list(req.output_versions),
            finish_reason=finish,  # type: ignore[arg-type]
            cached_tokens=req.cached_tokens,
        )


def _rfind(haystack: list[int], needle: list[int]) -> int:
    """Start of the last occurrence of `needle` in `haystack`, or -1."""
    n = len(needle)
    if n == 0 or n > len(haystack):
        return -1
    first = needle[0]
    for start in range(len(haystack) - n, -1, -1):
        if haystack[start] == first and haystack[start : start + n] == needle:
            return start
    return -1
