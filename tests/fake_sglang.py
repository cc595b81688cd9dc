"""Test-only: an HTTP server speaking SGLang's native API, backed by a torch engine over the tiny model.

It answers the routes `gyre_ray.engines.sglang` uses with SGLang's JSON shapes (read from SGLang's
`http_server.py` / `io_struct.py`): `/generate` (token ids in, `output_ids` and
`meta_info.output_token_logprobs` triples out, streamed as `data:` lines ending in `[DONE]`,
cumulative by default or as deltas with `incremental=True`), `/abort_request`, `/flush_cache`
(refused with 400 while requests run, as SGLang does), `/release_memory_occupation` and
`/resume_memory_occupation` (refused while requests run), `/update_weights_from_disk`,
`/update_weights_from_tensor` (payload: base64 of `torch.save`, this fake's own encoding),
`/init_weights_update_group` + `/update_weights_from_distributed` (a real gloo broadcast from rank
0, the group built by `weight_sync.open_group`, the recipe of SGLang's own side), `/health_generate`
and `/get_server_info`. Like SGLang it stops at the model's eos unless `ignore_eos`.
Like SGLang started with `--api-key` (as the engine starts it: `launch_command`'s `--config` file,
read with `key_from_command`), it refuses with 401 `{"error": "Unauthorized"}` every request without
`Authorization: Bearer KEY` except OPTIONS and paths starting `/health`, `/ready` or `/metrics`
(SGLang 0.5.23 `utils/auth.py`, `decide_request_auth`, with only `api_key` set); by default it makes
a fresh key (`api_key`), `api_key=None` is a server started without one. Refused paths are kept
in `refused`.
Knobs for failure tests: `hang_generate` (generate never answers), `close()` (the server is gone).
"""

from __future__ import annotations

import asyncio
import base64
import io
import json
import secrets
import socket
import threading
import time
from pathlib import Path
from typing import Any

import torch
import yaml
from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response, StreamingResponse

from gyre_ray.engines.base import EngineInputError, GenerateRequest, SamplingParams, TokenEvent
from gyre_ray.engines.sglang.server import new_api_key
from gyre_ray.engines.sglang.weight_sync import open_group
from gyre_ray.engines.torch_engine import TorchEngine
from gyre_ray.model.checkpoint import read_hf_weights


def encode_tensors(named: list[tuple[str, torch.Tensor]]) -> str:
    """This fake's `serialized_named_tensors` entry (real SGLang uses its MultiprocessingSerializer)."""
    buffer = io.BytesIO()
    torch.save(dict(named), buffer)
    return base64.b64encode(buffer.getvalue()).decode()


_NEW_KEY: Any = object()  # FakeSGLang's default: a fresh key, as the engine gives every server it starts
_OPEN_PREFIXES = ("/health", "/ready", "/metrics")  # SGLang answers these without a key


def key_from_command(argv: list[str]) -> str | None:
    """The `api_key` SGLang takes from a `sglang.launch_server` command line: `--config FILE`'s
    `api-key` (or `api_key`), overridden by an `--api-key` on the line itself (SGLang merges the file
    first, then the line's arguments)."""
    key = None
    if "--config" in argv:
        config = yaml.safe_load(Path(argv[argv.index("--config") + 1]).read_text()) or {}
        key = config.get("api-key", config.get("api_key"))
    for index, arg in enumerate(argv):
        if arg == "--api-key":
            key = argv[index + 1]
        elif arg.startswith("--api-key="):
            key = arg.split("=", 1)[1]
    return None if key is None else str(key)


class _RequireKey:
    """ASGI middleware: SGLang's check of `Authorization: Bearer KEY` (with only `api_key` configured)."""

    def __init__(self, app: Any, fake: FakeSGLang) -> None:
        self.app = app
        self.fake = fake

    async def __call__(self, scope: dict, receive: Any, send: Any) -> None:
        fake = self.fake
        if scope["type"] == "http" and fake.api_key is not None:
            request = Request(scope, receive=receive)
            if request.method != "OPTIONS" and not request.url.path.startswith(_OPEN_PREFIXES):
                scheme, _, token = (request.headers.get("authorization") or "").partition(" ")
                if scheme.lower() != "bearer" or not secrets.compare_digest(token, fake.api_key):
                    fake.refused.append(request.url.path)
                    await JSONResponse({"error": "Unauthorized"}, status_code=401)(scope, receive, send)
                    return
        await self.app(scope, receive, send)


class FakeSGLang:
    """The fake server on a free loopback port; `url`, `calls` (route, body) and knobs.

    `token_delay_s` paces the stream as a real server's decode does (a token takes milliseconds
    there): without it the tiny model can finish a request before an abort sent after its first
    tokens gets there, and tests of aborts and moves race the machine's speed."""

    def __init__(
        self,
        engine: TorchEngine,
        incremental: bool = False,
        token_delay_s: float = 0.0,
        api_key: str | None = _NEW_KEY,
    ) -> None:
        import uvicorn

        self.api_key: str | None = new_api_key() if api_key is _NEW_KEY else api_key
        self.refused: list[str] = []  # paths refused for a missing or wrong key
        self.engine = engine
        self.args = engine.args
        self.incremental = incremental
        self.token_delay_s = token_delay_s
        self.state = {k: v.detach().clone() for k, v in engine.model.state_dict().items()}
        self.weight_version = "0"
        self.calls: list[tuple[str, dict[str, Any]]] = []
        self.hang_generate = False
        self.flushes = 0
        self.released_tags: list[Any] = []
        self.groups: dict[str, Any] = {}
        self.running: set[str] = set()
        self.aborted: set[str] = set()  # running requests an abort reached
        self.app = self._build_app()
        sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
        sock.bind(("127.0.0.1", 0))
        self.port = sock.getsockname()[1]
        self.url = f"http://127.0.0.1:{self.port}"
        self.server = uvicorn.Server(uvicorn.Config(self.app, log_level="warning", lifespan="off"))
        self.thread = threading.Thread(target=self.server.run, kwargs={"sockets": [sock]}, daemon=True)
        self.thread.start()
        deadline = time.monotonic() + 30
        while not self.server.started:
            assert time.monotonic() < deadline, "the fake SGLang server did not start"
            time.sleep(0.02)

    def close(self) -> None:
        self.hang_generate = False
        self.server.should_exit = True
        self.thread.join(timeout=30)

    def routes(self) -> list[str]:
        return [route for route, _ in self.calls]

    # ---- translation ----------------------------------------------------------------------------
    def _request(self, body: dict[str, Any]) -> GenerateRequest:
        params = body.get("sampling_params") or {}
        stops = list(params.get("stop_token_ids") or [])
        if not params.get("ignore_eos") and self.args.eos_token_id is not None:
            stops.append(self.args.eos_token_id)
        sampling = SamplingParams(
            temperature=params.get("temperature", 1.0),
            top_p=params.get("top_p", 1.0),
            max_new_tokens=params.get("max_new_tokens", 128),
            stop_token_ids=stops,
            seed=params.get("sampling_seed"),
        )
        return GenerateRequest(body.get("rid") or f"fake-{time.monotonic_ns()}", body["input_ids"], sampling)

    def _chunk(self, request: GenerateRequest, tokens: list[TokenEvent], start: int, reason: Any) -> dict:
        shown = tokens[start:] if self.incremental else tokens
        meta = {
            "id": request.rid,
            "finish_reason": reason,
            "prompt_tokens": len(request.input_ids),
            "completion_tokens": len(tokens),
            "cached_tokens": 0,
            "output_token_logprobs": [[t.logprob, t.token_id, None] for t in shown],
            "weight_version": self.weight_version,
            "weight_versions": self._spans(tokens),
        }
        return {"output_ids": [t.token_id for t in shown], "meta_info": meta}

    @staticmethod
    def _spans(tokens: list[TokenEvent]) -> list[dict[str, Any]]:
        """SGLang 0.5.23's per-token version spans: runs of tokens made by one weight version."""
        spans: list[dict[str, Any]] = []
        for index, token in enumerate(tokens):
            if spans and spans[-1]["version"] == str(token.version):
                spans[-1]["end"] = index + 1
            else:
                spans.append({"version": str(token.version), "start": index, "end": index + 1})
        return spans

    @staticmethod
    def _reason(event: TokenEvent, request: GenerateRequest) -> dict[str, Any] | None:
        if event.finish_reason == "stop":
            return {"type": "stop", "matched": event.token_id}
        if event.finish_reason == "length":
            return {"type": "length", "length": request.sampling.max_new_tokens}
        if event.finish_reason == "abort":
            return {"type": "abort", "message": "Abort in waiting queue or running batch"}
        return None

    async def _generate_chunks(self, request: GenerateRequest):
        tokens: list[TokenEvent] = []
        self.running.add(request.rid)
        try:
            ended = False
            async for event in self.engine.stream(request):
                if ended:  # read the torch engine's stream to its end, so that the rid is free again
                    continue
                start = len(tokens)
                if request.rid in self.aborted and event.finish_reason is None:
                    # the torch engine may have run ahead of this paced stream: the abort ends it
                    # here, with no new token (what it made past this point is dropped)
                    abort = TokenEvent(request.rid, -1, 0.0, event.version, "abort")
                    yield self._chunk(request, tokens, start, self._reason(abort, request))
                    ended = True
                    continue
                if event.token_id >= 0:
                    tokens.append(event)
                yield self._chunk(request, tokens, start, self._reason(event, request))
                if self.token_delay_s > 0:
                    await asyncio.sleep(self.token_delay_s)
        finally:
            self.running.discard(request.rid)
            self.aborted.discard(request.rid)

    # ---- the app --------------------------------------------------------------------------------
    def _build_app(self) -> FastAPI:  # noqa: C901 - one route per SGLang endpoint
        app = FastAPI()
        app.add_middleware(_RequireKey, fake=self)
        fake = self

        @app.post("/generate")
        async def generate(raw: Request) -> Any:
            body = await raw.json()
            fake.calls.append(("/generate", body))
            while fake.hang_generate:  # until close()
                await asyncio.sleep(0.05)
            try:
                request = fake._request(body)
            except (KeyError, TypeError, ValueError) as exc:
                return JSONResponse({"error": {"message": f"bad request: {exc}"}}, status_code=400)
            if not body.get("stream"):
                last = None
                try:
                    async for chunk in fake._generate_chunks(request):
                        last = chunk
                except EngineInputError as exc:
                    return JSONResponse({"error": {"message": str(exc)}}, status_code=400)
                return JSONResponse(last)

            async def events():
                try:
                    async for chunk in fake._generate_chunks(request):
                        yield b"data: " + json.dumps(chunk).encode() + b"\n\n"
                except EngineInputError as exc:
                    yield b"data: " + json.dumps({"error": {"message": str(exc)}}).encode() + b"\n\n"
                yield b"data: [DONE]\n\n"

            return StreamingResponse(events(), media_type="text/event-stream")

        @app.post("/abort_request")
        async def abort_request(raw: Request) -> Response:
            body = await raw.json()
            fake.calls.append(("/abort_request", body))
            rids = list(fake.running) if body.get("abort_all") else [body.get("rid")]
            for rid in rids:
                if rid in fake.running:
                    fake.aborted.add(rid)
                await fake.engine.abort(rid)
            return Response(status_code=200)

        @app.api_route("/flush_cache", methods=["GET", "POST"])
        async def flush_cache() -> Response:
            fake.calls.append(("/flush_cache", {}))
            if fake.running:
                return Response("Cache not flushed: requests are running.\n", status_code=400)
            fake.flushes += 1
            return Response("Cache flushed.\n", status_code=200)

        @app.post("/release_memory_occupation")
        async def release(raw: Request) -> Any:
            body = await raw.json()
            fake.calls.append(("/release_memory_occupation", body))
            if fake.running:
                return JSONResponse({"error": {"message": "requests are running"}}, status_code=400)
            fake.released_tags.append(body.get("tags"))
            await fake.engine.release_memory()
            return Response(status_code=200)

        @app.post("/resume_memory_occupation")
        async def resume(raw: Request) -> Any:
            body = await raw.json()
            fake.calls.append(("/resume_memory_occupation", body))
            await fake.engine.resume_memory()
            await fake._load({}, fake.weight_version)  # the memory saver restores the weights it backed up
            return Response(status_code=200)

        @app.post("/update_weights_from_disk")
        async def from_disk(raw: Request) -> Any:
            body = await raw.json()
            fake.calls.append(("/update_weights_from_disk", body))
            try:
                state = await asyncio.to_thread(read_hf_weights, body["model_path"])
            except OSError as exc:
                return JSONResponse({"success": False, "message": str(exc)}, status_code=400)
            return await fake._answer(state, body)

        @app.post("/update_weights_from_tensor")
        async def from_tensor(raw: Request) -> Any:
            body = await raw.json()
            fake.calls.append(("/update_weights_from_tensor", body))
            entries = body["serialized_named_tensors"]
            state = torch.load(io.BytesIO(base64.b64decode(entries[0])), weights_only=True)
            return await fake._answer(state, body)

        @app.post("/init_weights_update_group")
        async def init_group(raw: Request) -> Any:
            body = await raw.json()
            fake.calls.append(("/init_weights_update_group", body))
            group = await asyncio.to_thread(
                open_group,
                body["master_address"],
                body["master_port"],
                body["rank_offset"],
                body["world_size"],
                body["group_name"],
                body.get("backend", "nccl"),
            )
            fake.groups[body["group_name"]] = group
            return JSONResponse({"success": True, "message": "Succeeded to initialize custom process group."})

        @app.post("/update_weights_from_distributed")
        async def from_distributed(raw: Request) -> Any:
            body = await raw.json()
            fake.calls.append(("/update_weights_from_distributed", body))
            group = fake.groups.get(body["group_name"])
            if group is None:
                return JSONResponse({"success": False, "message": "no such group"}, status_code=400)

            def receive() -> dict[str, torch.Tensor]:
                out = {}
                for name, dtype, shape in zip(body["names"], body["dtypes"], body["shapes"], strict=True):
                    tensor = torch.empty(shape, dtype=getattr(torch, dtype))
                    group.broadcast(tensor)
                    out[name] = tensor
                return out

            return await fake._answer(await asyncio.to_thread(receive), body)

        @app.get("/health_generate")
        async def health() -> Response:
            return Response(status_code=200)

        @app.get("/get_server_info")
        async def server_info() -> Any:
            return {"version": "fake", "weight_version": fake.weight_version}

        return app

    async def _answer(self, state: dict[str, torch.Tensor], body: dict[str, Any]) -> JSONResponse:
        """Load `state` at the body's weight_version; SGLang's {"success", "message"} reply (400 if refused)."""
        try:
            await self._load(state, body.get("weight_version"))
        except EngineInputError as exc:
            return JSONResponse({"success": False, "message": str(exc)}, status_code=400)
        return JSONResponse({"success": True, "message": "Succeeded to update model weights."})

    async def _load(self, state: dict[str, torch.Tensor], version: str | None) -> None:
        """Apply a (possibly partial) HF-named update, as SGLang's loaders do."""
        unknown = sorted(set(state) - set(self.state))
        if unknown:
            raise EngineInputError(f"unknown parameters {unknown}")
        for name, tensor in state.items():
            if tuple(tensor.shape) != tuple(self.state[name].shape):
                raise EngineInputError(
                    f"{name}: shape {tuple(tensor.shape)} != {tuple(self.state[name].shape)}"
                )
            self.state[name] = tensor.clone()
        if version is not None:
            self.weight_version = str(version)
        await self.engine.update_weights(dict(self.state), int(self.weight_version))
