"""The torch rollout engine: continuous batching, prefix cache and KV migration on CPU (or one GPU).

A background thread runs the loop; asyncio callers (a Ray async actor, the proxy, tests) talk to it
through commands that it executes between model steps (the safe points) and read its output through
per-request event queues, so any number of coroutines may call it concurrently. Each iteration runs
the queued commands (new requests, abort, export, weight update, release / resume), then one
`Scheduler.step()` (prefill what fits, one decode step per batch), then delivers the events. Woken
from idle, the loop first lets a burst of concurrent submissions finish arriving (`_await_burst`).
Requests are validated on the caller's side: bad input raises `EngineInputError` there and never
reaches the loop.
"""

from __future__ import annotations

import asyncio
import atexit
import concurrent.futures
import contextlib
import dataclasses
import threading
import time
import weakref
from collections import deque
from collections.abc import AsyncIterator, Sequence
from typing import Any

import torch

from gyre_ray.engines.base import (
    EngineClosedError,
    EngineInputError,
    GenerateRequest,
    GenerateResult,
    KVState,
    PrefixState,
    RolloutEngine,
    TokenEvent,
)
from gyre_ray.engines.requests import ActiveRequest, EventSink, Outbox, check_request, check_token_ids
from gyre_ray.engines.sampling import make_generator
from gyre_ray.engines.scheduler import Scheduler
from gyre_ray.engines.weights import WeightHolder
from gyre_ray.model.arch import ModelArgs
from gyre_ray.model.kv_cache import KVCache
from gyre_ray.model.packed_linear import pack_inference_weights

_COUNTERS = (
    "requests",
    "finished",
    "aborted",
    "exported",
    "imported",
    "failed",
    "prompt_tokens",
    "prefill_computed_tokens",
    "prefix_cached_tokens",
    "imported_tokens",
    "decode_tokens",
    "decode_steps",
    "weight_updates",
    "prefix_exported_tokens",
    "prefix_imported_tokens",
    "prefix_imports_stale",
)
_LIVE_ENGINES: weakref.WeakSet[TorchEngine] = weakref.WeakSet()  # shut down at exit
BURST_WINDOW_S = 0.002  # an idle engine's wait for the next request of a burst (TorchEngine._await_burst)


@atexit.register
def _shutdown_live_engines() -> None:
    """Stop engine threads before the interpreter tears torch down under them."""
    for engine in list(_LIVE_ENGINES):
        engine.shutdown()


class TorchEngine(RolloutEngine):
    """`RolloutEngine` over a gyre-ray `Qwen3ForCausalLM` held in this process."""

    supports_prefix_export = True

    def __init__(
        self,
        model: torch.nn.Module,
        args: ModelArgs,
        *,
        max_batch_size: int = 16,
        prefix_cache_tokens: int = 262_144,
        version: int = 0,
        prefill_chunk_tokens: int = 1024,
        stop_token_ids: Sequence[int] | None = None,
        free_weights_on_release: bool = True,
        max_padding_ratio: float = 1.0,
        torch_threads: int | None = None,
    ) -> None:
        """`stop_token_ids` end every request (default: the model's eos); requests add their own.

        `max_padding_ratio`: a request joins a decode batch only if every row there keeps at least
        1 / (1 + ratio) of the batch's cache width as real tokens; otherwise it opens another batch.
        `torch_threads`: intra-op threads for the model (torch's setting is process-wide); None
        leaves it alone. Small models on few cores run fastest with 1 (what Ray gives an actor).
        """
        if max_batch_size < 1 or prefill_chunk_tokens < 1:
            raise ValueError("max_batch_size and prefill_chunk_tokens must be >= 1")
        self.model = model.eval()
        self.args = args
        self.max_batch_size = max_batch_size
        if torch_threads is not None:
            torch.set_num_threads(torch_threads)
        if stop_token_ids is None:
            stop_token_ids = [] if args.eos_token_id is None else [args.eos_token_id]
        self.stop_token_ids = frozenset(check_token_ids(stop_token_ids, args.vocab_size, "stop_token_ids"))
        self.device = next(model.parameters()).device
        if hasattr(model, "lm_head") and hasattr(model, "model"):
            pack_inference_weights(model, rows_hint=min(max_batch_size, 16))
        self._weights = WeightHolder(model, free_on_release=free_weights_on_release)
        self._stats = dict.fromkeys(_COUNTERS, 0)
        self._busy_seconds = 0.0
        self._released = False
        self._wake = threading.Condition()
        self._commands: deque[tuple[str, Any, concurrent.futures.Future | None]] = deque()
        self._active: dict[str, ActiveRequest] = {}  # every request not yet finished (guarded by _wake)
        self._outbox = Outbox()  # engine thread only
        self._scheduler = Scheduler(  # engine thread only
            model,
            max_batch_size=max_batch_size,
            prefill_chunk_tokens=prefill_chunk_tokens,
            max_padding_ratio=max_padding_ratio,
            prefix_cache_tokens=prefix_cache_tokens,
            version=version,
            stats=self._stats,
            outbox=self._outbox,
            forget=self._forget,
        )
        self._closed = False
        self._thread = threading.Thread(target=self._run, name="gyre-torch-engine", daemon=True)
        self._thread.start()
        _LIVE_ENGINES.add(self)

    # ------------------------------------------------------------------ public API (any thread)
    @property
    def version(self) -> int:
        return self._scheduler.version

    async def generate(self, request: GenerateRequest) -> GenerateResult:
        req = self._submit(request, tokens=False)
        async for _ in self._events(req):
            pass
        return req.final

    async def stream(self, request: GenerateRequest) -> AsyncIterator[TokenEvent]:
        req = self._submit(request)
        async for event in self._events(req):
            yield event

    async def abort(self, rid: str) -> GenerateResult | None:
        return await asyncio.wrap_future(self._command("abort", rid))

    async def export_kv(self, rid: str) -> KVState:
        return await asyncio.wrap_future(self._command("export", rid))

    async def import_kv(self, state: KVState) -> AsyncIterator[TokenEvent]:
        req = self._submit_import(state)
        async for event in self._events(req):
            yield event

    async def export_prefix(self, tokens: list[int]) -> PrefixState | None:
        ids = check_token_ids(tokens, self.args.vocab_size, "tokens")
        return await asyncio.wrap_future(self._command("export_prefix", ids))

    async def import_prefix(self, state: PrefixState) -> int:
        ids = check_token_ids(state.tokens, self.args.vocab_size, "PrefixState.tokens")
        cache = self._check_kv(state.kv, len(ids))
        if cache.length != len(ids):
            raise EngineInputError(f"PrefixState.kv covers {cache.length} tokens, its tokens are {len(ids)}")
        if not ids:
            return 0
        return await asyncio.wrap_future(self._command("import_prefix", (ids, cache, state.version)))

    async def update_weights(self, state_dict: dict[str, Any], version: int) -> None:
        if isinstance(version, bool) or not isinstance(version, int):
            raise EngineInputError(f"version must be an integer, got {version!r}")
        await asyncio.wrap_future(self._command("update_weights", (state_dict, version)))

    async def release_memory(self) -> None:
        await asyncio.wrap_future(self._command("release", None))

    async def resume_memory(self) -> None:
        await asyncio.wrap_future(self._command("resume", None))

    def stats(self) -> dict[str, Any]:
        scheduler = self._scheduler
        out: dict[str, Any] = dict(self._stats)
        out.update(
            running=sum(len(b) for b in list(scheduler.batches)),
            waiting=len(scheduler.waiting),
            decode_batches=len(scheduler.batches),
            version=scheduler.version,
            prefix_cache_tokens=scheduler.prefix.stored_tokens,
            prefix_cache_evicted_tokens=scheduler.prefix.evicted_tokens,
            busy_seconds=round(self._busy_seconds, 6),
            released=self._released,
            weights_loaded=self._weights.loaded,
            max_batch_size=self.max_batch_size,
        )
        return out

    def shutdown(self) -> None:
        """Stop the loop; unfinished requests end as aborted. Safe to call twice."""
        with self._wake:
            if self._closed:
                return
            self._closed = True
            self._wake.notify()
        self._thread.join()

    # ------------------------------------------------------------------ caller-side plumbing
    def _command(self, kind: str, payload: Any) -> concurrent.futures.Future:
        future: concurrent.futures.Future = concurrent.futures.Future()
        with self._wake:
            if self._closed:
                raise EngineClosedError("the engine has been shut down")
            self._commands.append((kind, payload, future))
            self._wake.notify()
        return future

    def _register(
        self, req: ActiveRequest, counter: str, prompt_tokens: int, imported_tokens: int = 0
    ) -> ActiveRequest:
        with self._wake:
            if self._closed:
                raise EngineClosedError("the engine has been shut down")
            if req.rid in self._active:
                raise EngineInputError(f"request id {req.rid!r} is already running in this engine")
            self._active[req.rid] = req
            self._commands.append(("add", req, None))
            self._stats[counter] += 1
            self._stats["prompt_tokens"] += prompt_tokens
            self._stats["imported_tokens"] += imported_tokens
            self._wake.notify()
        return req

    def _new_request(
        self, rid: str, ids: list[int], sampling: Any, seed: int | None, tokens: bool = True
    ) -> ActiveRequest:
        if not isinstance(rid, str) or not rid:
            raise EngineInputError(f"request id must be a non-empty string, got {rid!r}")
        generator, seed = make_generator(seed, sampling.draws_done)
        return ActiveRequest(
            rid=rid,
            input_ids=ids,
            sampling=dataclasses.replace(sampling, stop_token_ids=list(sampling.stop_token_ids)),
            generator=generator,
            seed=seed,
            stop_ids=self.stop_token_ids | frozenset(sampling.stop_token_ids),
            sink=EventSink(rid, asyncio.get_running_loop(), tokens),
        )

    def _submit(self, request: GenerateRequest, tokens: bool = True) -> ActiveRequest:
        ids = check_request(request.input_ids, request.sampling, self.args.vocab_size, self.max_context)
        req = self._new_request(request.rid, ids, request.sampling, request.sampling.seed, tokens)
        return self._register(req, "requests", len(ids))

    def _submit_import(self, state: KVState) -> ActiveRequest:
        ids = check_request(state.input_ids, state.sampling, self.args.vocab_size, self.max_context)
        outputs = check_token_ids(state.output_ids, self.args.vocab_size, "output_ids")
        if not len(outputs) == len(state.output_logprobs) == len(state.output_versions):
            raise EngineInputError("KVState output_ids, output_logprobs and output_versions differ in length")
        req = self._new_request(state.rid, ids, state.sampling, state.sampling.seed)
        if state.rng_state is not None:
            req.generator.set_state(state.rng_state)
        req.output_ids, req.output_logprobs = outputs, list(state.output_logprobs)
        req.output_versions = list(state.output_versions)
        if len(outputs) >= state.sampling.max_new_tokens or (outputs and outputs[-1] in req.stop_ids):
            raise EngineInputError(f"request {state.rid!r} has already finished; nothing to continue")
        req.cache = self._check_kv(state.kv, req.kv_target)
        req.cached_tokens = req.cache.length
        req.prefix_looked_up = req.cache.length > 0
        req.kv_version = state.version if req.cache.length else None
        return self._register(req, "imported", 0, imported_tokens=req.cache.length)

    def _check_kv(self, kv: Any, limit: int) -> KVCache:
        """The imported KV as a cache of this model's layout, or EngineInputError saying what differs."""
        if not kv:
            return KVCache()
        try:
            cache = KVCache.from_state(kv, device=self.device, dtype=self._weights.dtype)
        except (ValueError, KeyError, TypeError, AttributeError) as exc:
            raise EngineInputError(f"KVState.kv is not a KV cache state: {exc}") from None
        a = self.args
        want = (a.num_hidden_layers, 1, a.num_key_value_heads, a.head_dim)
        k0 = cache.keys(0) if cache.num_layers else None
        got = (cache.num_layers, *((k0.size(0), k0.size(1), k0.size(3)) if k0 is not None else (0, 0, 0)))
        if got != want:
            raise EngineInputError(
                f"KVState.kv has (layers, rows, kv_heads, head_dim) {got}; this model needs {want}"
            )
        if cache.length > limit:
            raise EngineInputError(f"KVState.kv covers {cache.length} tokens but the request has {limit}")
        return cache

    async def _events(self, req: ActiveRequest) -> AsyncIterator[TokenEvent]:
        done = False
        try:
            while True:
                item = await req.sink.queue.get()
                if isinstance(item, BaseException):
                    done = True
                    raise item
                if item.finish_reason is not None:
                    done = True
                yield item
                if done:
                    return
        finally:
            if not done:  # the consumer went away early: stop generating for it
                self._command_quietly("abort", req.rid)

    def _command_quietly(self, kind: str, payload: Any) -> None:
        with contextlib.suppress(EngineClosedError):
            self._command(kind, payload)

    @property
    def max_context(self) -> int:
        return self.args.max_position_embeddings

    # ------------------------------------------------------------------ engine thread
    def _run(self) -> None:
        while True:
            with self._wake:
                idle = not self._can_step()
                while not self._commands and not self._closed and not self._can_step():
                    self._wake.wait()
                if idle and not self._closed:
                    self._await_burst()
                commands = list(self._commands)
                self._commands.clear()
                closing = self._closed
            for kind, payload, future in commands:
                self._execute(kind, payload, future)
            if closing:
                self._scheduler.abort_all()
                self._flush()
                return
            if self._can_step():
                started = time.perf_counter()
                with torch.inference_mode():
                    self._scheduler.step()
                self._busy_seconds += time.perf_counter() - started
            self._flush()

    def _await_burst(self) -> None:
        """Woken from idle (lock held): let a burst of requests finish arriving before the first step.

        Callers submit concurrent requests one after another; an engine that started prefilling the
        first alone would prefill the rest in a second forward (the weights read twice) and decode
        the first one step ahead of them. Each arrival extends the wait by `BURST_WINDOW_S`."""
        count = len(self._commands)
        while count and not self._closed:
            self._wake.wait(timeout=BURST_WINDOW_S)
            if len(self._commands) == count:
                return
            count = len(self._commands)

    def _can_step(self) -> bool:
        return not self._released and self._weights.loaded and self._scheduler.has_work()

    def _execute(self, kind: str, payload: Any, future: concurrent.futures.Future | None) -> None:
        scheduler = self._scheduler
        try:
            result = None
            if kind == "add":
                scheduler.add(payload)
            elif kind == "abort":
                result = scheduler.abort(payload)
            elif kind == "export":
                result = scheduler.export(payload)
            elif kind == "export_prefix":
                result = scheduler.export_prefix(payload)
            elif kind == "import_prefix":
                result = 0 if self._released else scheduler.import_prefix(*payload)
            elif kind == "update_weights":
                state_dict, version = payload
                self._weights.load(state_dict)
                scheduler.set_version(version)
                self._stats["weight_updates"] += 1
            elif kind == "release":
                self._released = True
                scheduler.prefix.clear()
                self._weights.release()
            elif kind == "resume":
                self._released = False
                self._weights.resume()
            else:
                raise ValueError(f"unknown engine command {kind!r}")
        except Exception as exc:  # reported to the caller; the engine keeps serving
            if future is not None:
                future.set_exception(exc)
            return
        if future is not None:
            future.set_result(result)

    def _forget(self, rid: str) -> None:
        with self._wake:
            self._active.pop(rid, None)

    def _flush(self) -> None:
        """Deliver this iteration's events; requests whose caller went away are aborted next."""
        for rid in self._outbox.flush():
            with self._wake:
                if rid in self._active:
                    self._commands.append(("abort", rid, None))
