"""`SGLangEngine`: the `RolloutEngine` contract over one SGLang server's HTTP API.

Every request is streamed from `/generate` with `return_logprob` by a pump task that turns chunks
into `TokenEvent`s, so `generate`, `stream` and `abort` (which returns the partial output) share
one path. SGLang has no per-request KV export (`kv_export = False`): `export_kv` aborts the
request and returns its tokens with `kv=None`, and `import_kv` continues such a state by
re-prefilling prompt + output so far (the server's radix cache may still hold that prefix). The
torch engine accepts the same states, so requests move between the two backends.
Weights: `update_weights(state_dict, version)` writes a safetensors folder and calls
`/update_weights_from_disk` (or `/update_weights_from_tensor` with `weight_sync="tensor"`);
`init_weights_group` / `update_weights_from_distributed` receive a broadcast from the trainer's
group (`gyre_ray.engines.sglang.weight_sync`). `release_memory` / `resume_memory` call the server's
memory-occupation routes around training; `flush_cache` empties its radix cache.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import json
import shutil
import tempfile
from collections.abc import AsyncIterator, Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, ClassVar

import torch
from safetensors.torch import save_file

from gyre_ray.engines.base import (
    ABORT_TOKEN_ID,
    EngineClosedError,
    EngineInputError,
    FinishReason,
    GenerateRequest,
    GenerateResult,
    KVState,
    RolloutEngine,
    TokenEvent,
    UnknownRequestError,
)
from gyre_ray.engines.requests import check_request, check_token_ids
from gyre_ray.engines.sglang.client import SGLangClient, SGLangServerError
from gyre_ray.engines.sglang.protocol import ChunkReader, finish_reason, generate_body, token_versions
from gyre_ray.engines.sglang.server import SGLangServer

_COUNTERS = (
    "requests",
    "finished",
    "aborted",
    "exported",
    "imported",
    "failed",
    "prompt_tokens",
    "reprefill_tokens",
    "prefix_cached_tokens",
    "decode_tokens",
    "weight_updates",
)
_END = object()
Serializer = Callable[[list[tuple[str, torch.Tensor]]], str]


@dataclass
class _Flight:
    request: GenerateRequest
    version: int
    queue: asyncio.Queue = field(default_factory=asyncio.Queue)
    output_ids: list[int] = field(default_factory=list)
    output_logprobs: list[float] = field(default_factory=list)
    output_versions: list[int] = field(default_factory=list)
    finish_reason: FinishReason | None = None
    cached_tokens: int = 0
    ended: asyncio.Event = field(default_factory=asyncio.Event)
    answered: asyncio.Event = field(default_factory=asyncio.Event)  # the server streamed a chunk of it
    pump: asyncio.Task | None = None
    prior: KVState | None = None  # an imported request: what it had produced before it came here

    def result(self) -> GenerateResult:
        return GenerateResult(
            rid=self.request.rid,
            input_ids=list(self.request.input_ids),
            output_ids=list(self.output_ids),
            output_logprobs=list(self.output_logprobs),
            output_versions=list(self.output_versions),
            finish_reason=self.finish_reason or "abort",
            cached_tokens=self.cached_tokens,
        )


class SGLangEngine(RolloutEngine):
    """Drives one SGLang server (started by the cell, or an existing one at `client.url`)."""

    kv_export: ClassVar[bool] = False  # no per-request KV export: migration re-prefills

    def __init__(
        self,
        client: SGLangClient,
        *,
        vocab_size: int,
        max_context: int,
        stop_token_ids: Sequence[int] = (),
        version: int = 0,
        weight_sync: str = "disk",
        model_config: dict[str, Any] | None = None,
        server: SGLangServer | None = None,
        tensor_serializer: Serializer | None = None,
        tp_size: int = 1,
        abort_wait_s: float = 10.0,
        abort_retry_s: float = 0.5,
    ) -> None:
        """`model_config`: the HF config.json written next to weights sent through disk.
        `server`: the process this engine owns (stopped by `shutdown`). `tensor_serializer`: turns
        named tensors into one entry of `serialized_named_tensors` (default: SGLang's own serializer);
        the server takes one entry per tensor-parallel rank (`tp_size`). An abort is sent again every
        `abort_retry_s` until the stream ends, and at once when the server first answers a request
        whose abort went out before any answer (it may have beaten the request there), at most
        `abort_wait_s` in all."""
        if weight_sync not in ("disk", "tensor"):
            raise ValueError(f"weight_sync must be 'disk' or 'tensor', got {weight_sync!r}")
        self.client = client
        self.cell_id = client.cell_id
        self.vocab_size = vocab_size
        self.max_context = max_context
        self.stop_token_ids = frozenset(check_token_ids(stop_token_ids, vocab_size, "stop_token_ids"))
        self.version = version
        self.weight_sync = weight_sync
        self.model_config = model_config
        self.server = server
        self.tensor_serializer = tensor_serializer
        self.tp_size = tp_size
        self.abort_wait_s = abort_wait_s
        self.abort_retry_s = abort_retry_s
        self._stats = dict.fromkeys(_COUNTERS, 0)
        self._flights: dict[str, _Flight] = {}
        self._released = False
        self._closed = False
        self._weights_dir: Path | None = None

    # ---- generation -----------------------------------------------------------------------------
    async def generate(self, request: GenerateRequest) -> GenerateResult:
        flight = self._start(request)
        async for _ in self._events(flight):
            pass
        return flight.result()

    async def stream(self, request: GenerateRequest) -> AsyncIterator[TokenEvent]:
        flight = self._start(request)
        async for event in self._events(flight):
            yield event

    async def abort(self, rid: str) -> GenerateResult | None:
        flight = self._flights.get(rid)
        if flight is None or flight.ended.is_set():
            return None
        deadline = asyncio.get_running_loop().time() + self.abort_wait_s
        while not flight.ended.is_set():  # again until it ends: the first may beat the request there
            unanswered = not flight.answered.is_set()
            with contextlib.suppress(SGLangServerError):
                await self.client.abort(rid)
            remaining = deadline - asyncio.get_running_loop().time()
            if remaining <= 0:  # the server did not end the stream: stop reading it
                if flight.pump is not None:
                    flight.pump.cancel()
                await flight.ended.wait()
                break
            # an abort sent before the server's first answer may have been ignored: send it again as
            # soon as that answer comes (the server knows the request then), not a retry period later
            await _first_of(
                [flight.ended, flight.answered] if unanswered else [flight.ended],
                min(self.abort_retry_s, remaining),
            )
        if flight.finish_reason != "abort":
            return None  # it finished on its own meanwhile
        return flight.result()

    async def export_kv(self, rid: str) -> KVState:
        """Stop the request and return its tokens; no KV (`kv=None`): the receiver re-prefills."""
        flight = self._flights.get(rid)
        result = await self.abort(rid)
        if flight is None or result is None:
            raise UnknownRequestError(f"request {rid!r} is not running in cell {self.cell_id}")
        self._stats["exported"] += 1
        prior = flight.prior
        if prior is None:
            return KVState(
                rid=rid,
                input_ids=result.input_ids,
                output_ids=result.output_ids,
                output_logprobs=result.output_logprobs,
                output_versions=result.output_versions,
                sampling=flight.request.sampling,
                kv=None,
                version=self.version,
            )
        return dataclasses.replace(  # moved again: the original prompt, everything produced so far
            prior,
            output_ids=list(prior.output_ids) + result.output_ids,
            output_logprobs=list(prior.output_logprobs) + result.output_logprobs,
            output_versions=list(prior.output_versions) + result.output_versions,
            kv=None,
            rng_state=None,
            version=self.version,
        )

    async def import_kv(self, state: KVState) -> AsyncIterator[TokenEvent]:
        """Continue an exported request by re-prefilling its prompt and output so far."""
        outputs = check_token_ids(state.output_ids, self.vocab_size, "output_ids")
        if not len(outputs) == len(state.output_logprobs) == len(state.output_versions):
            raise EngineInputError("KVState output_ids, output_logprobs and output_versions differ in length")
        remaining = state.sampling.max_new_tokens - len(outputs)
        stops = self.stop_token_ids | frozenset(state.sampling.stop_token_ids)
        if remaining < 1 or (outputs and outputs[-1] in stops):
            raise EngineInputError(f"request {state.rid!r} has already finished; nothing to continue")
        sampling = dataclasses.replace(state.sampling, max_new_tokens=remaining)
        request = GenerateRequest(state.rid, list(state.input_ids) + outputs, sampling)
        flight = self._start(request, counter="imported")
        flight.prior = state
        self._stats["reprefill_tokens"] += len(request.input_ids)
        async for event in self._events(flight):
            yield event

    def _start(self, request: GenerateRequest, counter: str = "requests") -> _Flight:
        if self._closed:
            raise EngineClosedError(f"cell {self.cell_id}: the SGLang engine has been shut down")
        if not isinstance(request.rid, str) or not request.rid:
            raise EngineInputError(f"request id must be a non-empty string, got {request.rid!r}")
        ids = check_request(request.input_ids, request.sampling, self.vocab_size, self.max_context)
        if request.rid in self._flights:
            raise EngineInputError(f"request id {request.rid!r} is already running in this engine")
        flight = _Flight(dataclasses.replace(request, input_ids=ids), self.version)
        self._flights[request.rid] = flight
        self._stats[counter] += 1
        self._stats["prompt_tokens"] += len(ids)
        flight.pump = asyncio.get_running_loop().create_task(self._pump(flight))
        return flight

    async def _pump(self, flight: _Flight) -> None:
        """Read the server's stream into the flight's queue; always ends with `_END`."""
        reader = ChunkReader()
        try:
            body = generate_body(flight.request, self.stop_token_ids)
            async for chunk in self.client.stream(body):
                flight.answered.set()
                meta = chunk.get("meta_info") or {}
                reason = finish_reason(meta)
                flight.cached_tokens = int(meta.get("cached_tokens", flight.cached_tokens) or 0)
                first = len(flight.output_ids)
                tokens = reader.new_tokens(chunk)
                versions = token_versions(meta, first, max(1, len(tokens)), flight.version)
                for index, (token, logprob) in enumerate(tokens):
                    flight.output_ids.append(token)
                    flight.output_logprobs.append(logprob)
                    flight.output_versions.append(versions[index])
                    self._stats["decode_tokens"] += 1
                    last = index == len(tokens) - 1
                    flight.queue.put_nowait(
                        TokenEvent(
                            flight.request.rid, token, logprob, versions[index], reason if last else None
                        )
                    )
                version = versions[-1]
                if reason is not None:
                    flight.finish_reason = reason
                    if reason == "abort":
                        flight.queue.put_nowait(
                            TokenEvent(flight.request.rid, ABORT_TOKEN_ID, 0.0, version, "abort")
                        )
                    elif not tokens:
                        raise SGLangServerError(
                            f"cell {self.cell_id}: SGLang ended request {flight.request.rid!r} ({reason}) "
                            "in a chunk without a token"
                        )
                    return
            raise SGLangServerError(f"cell {self.cell_id}: the stream of {flight.request.rid!r} ended early")
        except asyncio.CancelledError:
            flight.finish_reason = flight.finish_reason or "abort"
            flight.queue.put_nowait(
                TokenEvent(flight.request.rid, ABORT_TOKEN_ID, 0.0, flight.version, "abort")
            )
        except Exception as exc:  # the caller of stream/generate gets it
            flight.finish_reason = flight.finish_reason or "abort"
            self._stats["failed"] += 1
            flight.queue.put_nowait(exc)
        finally:
            self._finish(flight)
            flight.queue.put_nowait(_END)

    def _finish(self, flight: _Flight) -> None:
        if self._flights.get(flight.request.rid) is flight:
            del self._flights[flight.request.rid]
        self._stats["prefix_cached_tokens"] += flight.cached_tokens
        if flight.finish_reason == "abort":
            self._stats["aborted"] += 1
        elif flight.finish_reason is not None:
            self._stats["finished"] += 1
        flight.ended.set()

    async def _events(self, flight: _Flight) -> AsyncIterator[TokenEvent]:
        done = False
        try:
            while True:
                item = await flight.queue.get()
                if item is _END:
                    done = True
                    return
                if isinstance(item, BaseException):
                    done = True
                    raise item
                yield item
        finally:
            if not done and not flight.ended.is_set():  # the consumer went away early
                asyncio.get_running_loop().create_task(self.abort(flight.request.rid))

    # ---- weights and memory ---------------------------------------------------------------------
    async def update_weights(self, state_dict: dict[str, Any], version: int) -> None:
        """Load HF-named weights into the server at `version` (its radix cache is flushed)."""
        if isinstance(version, bool) or not isinstance(version, int):
            raise EngineInputError(f"version must be an integer, got {version!r}")
        if not isinstance(state_dict, dict) or not state_dict:
            raise EngineInputError("state_dict must be a non-empty dict of tensors")
        named = [(name, torch.as_tensor(t).detach().to("cpu").contiguous()) for name, t in state_dict.items()]
        if self.weight_sync == "tensor":
            serialize = self.tensor_serializer or _sglang_serializer
            await self.client.update_weights_from_tensor([serialize(named)] * self.tp_size, version)
        else:
            folder = await asyncio.to_thread(self._write_weights, named, version)
            try:
                await self.client.update_weights_from_disk(str(folder), version)
            finally:
                shutil.rmtree(folder, ignore_errors=True)
        self.version = version
        self._stats["weight_updates"] += 1

    def _write_weights(self, named: list[tuple[str, torch.Tensor]], version: int) -> Path:
        if self._weights_dir is None:
            self._weights_dir = Path(tempfile.mkdtemp(prefix=f"gyre-sglang-{self.cell_id}-"))
        folder = self._weights_dir / f"v{version}"
        folder.mkdir(parents=True, exist_ok=True)
        seen: set[tuple[int, tuple[int, ...]]] = set()
        unique = {}
        for name, tensor in named:  # a tied lm_head shares the embedding's storage: write it once
            key = (tensor.data_ptr(), tuple(tensor.shape))
            if key not in seen:
                seen.add(key)
                unique[name] = tensor
        save_file(unique, str(folder / "model.safetensors"), metadata={"format": "pt"})
        if self.model_config is not None:
            (folder / "config.json").write_text(json.dumps(self.model_config, indent=2) + "\n")
        return folder

    async def init_weights_group(
        self, master_address: str, master_port: int, rank_offset: int, world_size: int, group_name: str,
        backend: str = "nccl",
    ) -> None:  # fmt: skip
        """Join the trainer's weight-broadcast group (the trainer is rank 0; this server's ranks
        start at `rank_offset`). The trainer must create its side at the same time."""
        await self.client.init_weights_update_group(
            master_address, master_port, rank_offset, world_size, group_name, backend
        )

    async def update_weights_from_distributed(
        self, names: list[str], dtypes: list[str], shapes: list[list[int]], version: int, group_name: str
    ) -> None:
        """Receive one bucket of tensors broadcast by rank 0 of `group_name` (the trainer sends meanwhile)."""
        await self.client.update_weights_from_distributed(names, dtypes, shapes, group_name, version)
        self.version = version
        self._stats["weight_updates"] += 1

    async def release_memory(self) -> None:
        await self.client.release_memory()
        self._released = True

    async def resume_memory(self) -> None:
        await self.client.resume_memory()
        self._released = False

    async def flush_cache(self) -> bool:
        """Empty the server's radix cache; False if it refused (requests were running)."""
        return await self.client.flush_cache()

    def stats(self) -> dict[str, Any]:
        out: dict[str, Any] = dict(self._stats)
        out.update(
            backend="sglang",
            url=self.client.url,
            running=len(self._flights),
            version=self.version,
            released=self._released,
            kv_export=self.kv_export,
        )
        return out

    def shutdown(self) -> None:
        """Stop taking requests, cancel reads in flight and stop the server this engine started."""
        self._closed = True
        for flight in list(self._flights.values()):
            if flight.pump is not None and not flight.pump.done():
                with contextlib.suppress(RuntimeError):  # its loop is already closed
                    flight.pump.get_loop().call_soon_threadsafe(flight.pump.cancel)
        if self.server is not None:
            self.server.stop()
        if self._weights_dir is not None:
            shutil.rmtree(self._weights_dir, ignore_errors=True)


def _sglang_serializer(named: list[tuple[str, torch.Tensor]]) -> str:
    """SGLang's own encoding of named tensors for /update_weights_from_tensor (one rank)."""
    try:
        from sglang.srt.utils import MultiprocessingSerializer
    except ImportError as exc:
        raise SGLangServerError(
            "engine.sglang.weight_sync=tensor needs the sglang package in this process; use 'disk'"
        ) from exc
    return MultiprocessingSerializer.serialize(named, output_str=True)


async def _first_of(events: list[asyncio.Event], timeout_s: float) -> None:
    """Wait until any of `events` is set, at most `timeout_s` seconds."""
    waiters = [asyncio.ensure_future(event.wait()) for event in events]
    try:
        await asyncio.wait(waiters, timeout=timeout_s, return_when=asyncio.FIRST_COMPLETED)
    finally:
        for waiter in waiters:
            waiter.cancel()
