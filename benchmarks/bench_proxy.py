"""Proxy benchmark: many concurrent multi-turn sessions through Ray Serve; errors and the proxy's own overhead.

    python benchmarks/bench_proxy.py [--sessions 200] [--turns 5] [--engine scripted|tiny] [--client aiohttp|httpx]

Starts a local Ray, two rollout cells and the proxy (`start_proxy`, one replica with Serve's direct
ingress). Each session registers an execution and holds a `--turns`-turn conversation (odd turns
streamed), re-sending its history, so every call after the first splices recorded outputs. Per call,
overhead = client end-to-end latency (real HTTP, whole response read) minus the time the call spent
inside its cell's engine (the record's `meta.engine_s`).

Everything is measured side by side in one run, on the same stack:
- `unloaded`: sessions one at a time, alternating between the two ways into the same Serve app:
  `direct` (the replica's own HTTP port, `ProxyHandle.base_url`) and `serve_proxy` (Serve's HTTP
  proxy actor, `ProxyHandle.serve_url`, which forwards each request to the replica by actor calls);
- `loaded`: all `--sessions` concurrent, through each route in turn;
- `breakdown`: where an unloaded call's overhead goes: Serve's ingress alone (a body-less GET and a
  small POST that touch no cell, per route), the same FastAPI app in-process over in-process cells
  (no HTTP, no Ray: the proxy's own code), and the Ray hop to a cell (this process -> cell actor,
  end-to-end minus engine time, as the replica does it).
The load generator is aiohttp by default: httpx costs several times more CPU per call and, with 200
connections on 2 cores, saturates a core by itself (then the loaded phase measures the client).
The default scripted engine spends a fixed, CPU-free time per token, so the figures isolate the proxy;
`--engine tiny` runs the tiny model instead. Results are printed and saved to
benchmarks/results/proxy_cpu<cpus>.json.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import platform
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

RESULTS = Path(__file__).resolve().parent / "results"
ROUTES = ("direct", "serve_proxy")


def percentile(values: list[float], q: float) -> float:
    if not values:
        return float("nan")
    ordered = sorted(values)
    index = min(len(ordered) - 1, max(0, round(q / 100 * (len(ordered) - 1))))
    return ordered[index]


def summary_ms(values: list[float]) -> dict[str, Any]:
    return {
        "n": len(values),
        "p50": round(percentile(values, 50) * 1e3, 2),
        "p99": round(percentile(values, 99) * 1e3, 2),
        "mean": round(statistics.fmean(values) * 1e3, 2) if values else None,
    }


# ---- HTTP clients: one small interface over aiohttp, httpx and an in-process ASGI app ----------------
class AiohttpClient:
    def __init__(self, base_url: str, connections: int) -> None:
        import aiohttp

        self.base_url = base_url
        connector = aiohttp.TCPConnector(limit=connections, limit_per_host=connections, force_close=False)
        self.session = aiohttp.ClientSession(connector=connector, timeout=aiohttp.ClientTimeout(total=600))

    async def request(self, method: str, path: str, body: Any = None, headers: dict | None = None):
        async with self.session.request(method, self.base_url + path, json=body, headers=headers) as r:
            return r.status, await r.read()

    async def stream(self, path: str, body: Any, headers: dict):
        """(status, SSE data payloads) of a streamed POST, read line by line as it arrives."""
        async with self.session.post(self.base_url + path, json=body, headers=headers) as r:
            if r.status != 200:
                return r.status, [await r.read()]
            return 200, [line[6:] async for line in r.content if line.startswith(b"data: ")]

    async def close(self) -> None:
        await self.session.close()


class HttpxClient:
    def __init__(self, base_url: str, connections: int) -> None:
        import httpx

        limits = httpx.Limits(max_connections=connections, max_keepalive_connections=connections)
        self.client = httpx.AsyncClient(base_url=base_url, timeout=600, limits=limits)

    async def request(self, method: str, path: str, body: Any = None, headers: dict | None = None):
        r = await self.client.request(method, path, json=body, headers=headers)
        return r.status_code, r.content

    async def stream(self, path: str, body: Any, headers: dict):
        async with self.client.stream("POST", path, json=body, headers=headers) as r:
            if r.status_code != 200:
                return r.status_code, [await r.aread()]
            return 200, [line[6:].encode() async for line in r.aiter_lines() if line.startswith("data: ")]

    async def close(self) -> None:
        await self.client.aclose()


class AsgiClient:
    """The app called in-process through ASGI: no socket, no HTTP parsing, no Ray."""

    def __init__(self, app: Any) -> None:
        self.app = app

    async def _call(self, method: str, path: str, body: Any, headers: dict | None):
        raw = b"" if body is None else json.dumps(body).encode()
        hdrs = [(k.lower().encode(), v.encode()) for k, v in (headers or {}).items()]
        hdrs += [(b"content-type", b"application/json"), (b"content-length", str(len(raw)).encode())]
        scope = {
            "type": "http",
            "asgi": {"version": "3.0"},
            "http_version": "1.1",
            "method": method,
            "scheme": "http",
            "path": path,
            "raw_path": path.encode(),
            "query_string": b"",
            "root_path": "",
            "headers": hdrs,
            "client": ("127.0.0.1", 1),
            "server": ("127.0.0.1", 80),
        }
        done = asyncio.Event()
        sent = False
        out: dict[str, Any] = {"status": 0, "chunks": []}

        async def receive() -> dict:
            nonlocal sent
            if not sent:
                sent = True
                return {"type": "http.request", "body": raw, "more_body": False}
            await done.wait()
            return {"type": "http.disconnect"}

        async def send(message: dict) -> None:
            if message["type"] == "http.response.start":
                out["status"] = message["status"]
            elif message["type"] == "http.response.body":
                out["chunks"].append(message.get("body", b""))
                if not message.get("more_body"):
                    done.set()

        await self.app(scope, receive, send)
        return out["status"], b"".join(out["chunks"])

    async def request(self, method: str, path: str, body: Any = None, headers: dict | None = None):
        return await self._call(method, path, body, headers)

    async def stream(self, path: str, body: Any, headers: dict):
        status, raw = await self._call("POST", path, body, headers)
        if status != 200:
            return status, [raw]
        return 200, [line[6:] for line in raw.split(b"\n") if line.startswith(b"data: ")]

    async def close(self) -> None:
        return None


def make_client(kind: str, base_url: str, connections: int):
    return (AiohttpClient if kind == "aiohttp" else HttpxClient)(base_url, connections)


# ---- sessions -----------------------------------------------------------------------------------------
async def session(
    client, admin: dict, turns: int, max_tokens: int, timings: dict, errors: list
) -> str | None:
    status, raw = await client.request("POST", "/gyre/executions", {}, admin)
    if status != 201:
        errors.append(f"register: status {status}: {raw[:200]!r}")
        return None
    created = json.loads(raw)
    headers = {"Authorization": f"Bearer {created['api_key']}"}
    messages = [{"role": "system", "content": "You are a benchmark agent."}]
    for turn in range(turns):
        messages.append({"role": "user", "content": f"turn {turn}: continue the work."})
        stream = turn % 2 == 1
        body = {
            "model": "m",
            "messages": messages,
            "max_tokens": max_tokens,
            "temperature": 0,
            "stream": stream,
        }
        start = time.perf_counter()
        try:
            if stream:
                status, payloads = await client.stream("/v1/chat/completions", body, headers)
                elapsed = time.perf_counter() - start
                if status != 200:
                    raise RuntimeError(f"status {status}: {payloads[0][:200]!r}")
                text, call_id = "", None
                for payload in payloads:
                    if payload.startswith(b"{"):
                        chunk = json.loads(payload)
                        if "error" in chunk:
                            raise RuntimeError(chunk["error"]["message"])
                        call_id = chunk["id"]
                        if chunk["choices"]:
                            text += chunk["choices"][0]["delta"].get("content") or ""
            else:
                status, raw = await client.request("POST", "/v1/chat/completions", body, headers)
                elapsed = time.perf_counter() - start
                if status != 200:
                    raise RuntimeError(f"status {status}: {raw[:200]!r}")
                reply = json.loads(raw)
                text, call_id = reply["choices"][0]["message"]["content"], reply["id"]
        except Exception as exc:
            errors.append(f"{type(exc).__name__}: {exc}")
            return created["execution_id"]
        timings[call_id.removeprefix("chatcmpl-")] = (elapsed, stream)
        messages.append({"role": "assistant", "content": text})
    return created["execution_id"]


async def engine_times(client, admin: dict, executions: list[str | None]) -> dict[str, float]:
    engine: dict[str, float] = {}
    for execution_id in executions:
        if execution_id is None:
            continue
        _, raw = await client.request("GET", f"/gyre/executions/{execution_id}/records", None, admin)
        for line in raw.decode().splitlines():
            record = json.loads(line)
            engine[record["call_id"]] = record["meta"]["engine_s"]
    return engine


def phase_stats(timings: dict, engine: dict, errors: list, wall: float, **info: Any) -> dict[str, Any]:
    overhead = [t - engine[c] for c, (t, _) in timings.items() if c in engine]
    by_mode = {
        mode: [t - engine[c] for c, (t, s) in timings.items() if c in engine and s == (mode == "stream")]
        for mode in ("stream", "non_stream")
    }
    return {
        **info,
        "calls": len(timings),
        "errors": len(errors),
        "error_examples": errors[:5],
        "missing_records": sum(1 for c in timings if c not in engine),
        "wall_s": round(wall, 3),
        "calls_per_s": round(len(timings) / wall, 2) if wall else None,
        "e2e_ms": summary_ms([t for t, _ in timings.values()]),
        "overhead_ms": summary_ms(overhead),
        "overhead_ms_by_mode": {mode: summary_ms(v) for mode, v in by_mode.items()},
    }


async def unloaded(clients: dict, admin: dict, sessions: int, turns: int, max_tokens: int) -> dict:
    """Sessions one at a time, alternating routes (same noise for both); one warm-up session each."""
    timings = {route: {} for route in clients}
    errors = {route: [] for route in clients}
    executions = {route: [] for route in clients}
    wall = dict.fromkeys(clients, 0.0)
    for client in clients.values():
        await session(client, admin, turns, max_tokens, {}, [])
    for i in range(sessions * len(clients)):
        route = list(clients)[i % len(clients)]
        start = time.perf_counter()
        executions[route].append(
            await session(clients[route], admin, turns, max_tokens, timings[route], errors[route])
        )
        wall[route] += time.perf_counter() - start
    out = {}
    for route, client in clients.items():
        engine = await engine_times(client, admin, executions[route])
        out[route] = phase_stats(timings[route], engine, errors[route], wall[route], sessions=sessions)
    return out


async def loaded(client, admin: dict, sessions: int, turns: int, max_tokens: int) -> dict:
    timings: dict = {}
    errors: list = []
    start = time.perf_counter()
    executions = await asyncio.gather(
        *(session(client, admin, turns, max_tokens, timings, errors) for _ in range(sessions))
    )
    wall = time.perf_counter() - start
    engine = await engine_times(client, admin, list(executions))
    return phase_stats(timings, engine, errors, wall, sessions=sessions, concurrent=True)


# ---- breakdown ----------------------------------------------------------------------------------------
async def ingress_alone(clients: dict, api_key: str, calls: int) -> dict:
    """Serve's ingress per route: a body-less GET and a small POST whose handler calls no actor."""
    body = {"model": "m", "messages": [{"role": "user", "content": "hi"}]}
    key = {"x-api-key": api_key}
    times: dict = {route: {"get_health": [], "post_count_tokens": []} for route in clients}
    for _ in range(calls):
        for route, client in clients.items():
            start = time.perf_counter()
            status, _ = await client.request("GET", "/gyre/health")
            times[route]["get_health"].append(time.perf_counter() - start)
            assert status == 200, status
            start = time.perf_counter()
            status, _ = await client.request("POST", "/v1/messages/count_tokens", body, key)
            times[route]["post_count_tokens"].append(time.perf_counter() - start)
            assert status == 200, status
    return {route: {name: summary_ms(v) for name, v in kinds.items()} for route, kinds in times.items()}


async def in_process_app(factory: Any, config: Any, sessions: int, turns: int, max_tokens: int) -> dict:
    """The same FastAPI app over in-process cells and store, called through ASGI (no HTTP, no Ray)."""
    from gyre_ray.proxy.codec import ChatCodec
    from gyre_ray.proxy.local import build_local_proxy

    local = await build_local_proxy(
        ChatCodec.for_model(config.model), factory, tempfile.mkdtemp(prefix="bench-proxy-local-")
    )
    admin = {"Authorization": f"Bearer {local.admin_token}"}
    client = AsgiClient(local.app)
    result = await unloaded({"in_process": client}, admin, sessions, turns, max_tokens)
    for cell in local.cells.values():
        cell.close()
    return result["in_process"]


async def cell_hop(actor: Any, calls: int, max_tokens: int) -> dict:
    """This process -> a cell actor (as the replica calls it): end-to-end minus the cell's engine time."""
    from gyre_ray.engines.base import GenerateRequest, SamplingParams

    out = {}
    for mode in ("non_stream", "stream"):
        overhead = []
        for i in range(calls):
            sampling = SamplingParams(temperature=0.0, max_new_tokens=max_tokens, stop_token_ids=[1])
            request = GenerateRequest(f"bench-hop-{mode}-{i}", list(range(300, 340)), sampling)
            start = time.perf_counter()
            if mode == "stream":
                events = [await ref async for ref in actor.generate.remote(request)]
            else:
                events = await actor.generate_all.remote(request)
            elapsed = time.perf_counter() - start
            overhead.append(elapsed - sum(getattr(e, "engine_seconds", None) or 0.0 for e in events))
        out[mode] = summary_ms(overhead)
    return out


# ---- main ---------------------------------------------------------------------------------------------
async def run_all(handle: Any, args: argparse.Namespace, factory: Any, config: Any) -> dict:
    admin = {"Authorization": f"Bearer {handle.admin_token}"}
    urls = {"direct": handle.base_url, "serve_proxy": getattr(handle, "serve_url", "") or handle.base_url}
    if urls["direct"] == urls["serve_proxy"]:
        print("warning: Serve runs without direct ingress; both routes are Serve's HTTP proxy", flush=True)
    connections = args.sessions + 8
    clients = {route: make_client(args.client, url, connections) for route, url in urls.items()}
    try:
        _, raw = await clients["direct"].request("POST", "/gyre/executions", {}, admin)
        key = json.loads(raw)["api_key"]
        breakdown = {"ingress_alone": await ingress_alone(clients, key, args.baseline_calls)}
        unloaded_phase = await unloaded(clients, admin, args.unloaded_sessions, args.turns, args.max_tokens)
        breakdown["cell_hop"] = await cell_hop(
            next(iter(handle.cell_actors().values())), args.baseline_calls, args.max_tokens
        )
        if factory is not None:
            breakdown["in_process_app"] = await in_process_app(
                factory, config, args.unloaded_sessions, args.turns, args.max_tokens
            )
        loaded_phase = {}
        for route in args.loaded_routes.split(","):
            loaded_phase[route] = await loaded(
                clients[route], admin, args.sessions, args.turns, args.max_tokens
            )
    finally:
        for client in clients.values():
            await client.close()
    return {"urls": urls, "breakdown": breakdown, "unloaded": unloaded_phase, "loaded": loaded_phase}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--sessions", type=int, default=200)
    parser.add_argument("--turns", type=int, default=5)
    parser.add_argument("--max-tokens", type=int, default=16)
    parser.add_argument("--engine", choices=["scripted", "tiny"], default="scripted")
    parser.add_argument("--token-delay-ms", type=float, default=2.0, help="scripted engine time per token")
    parser.add_argument("--unloaded-sessions", type=int, default=30, help="per route")
    parser.add_argument("--baseline-calls", type=int, default=100)
    parser.add_argument("--client", choices=["aiohttp", "httpx"], default="aiohttp")
    parser.add_argument("--loaded-routes", default="direct,serve_proxy")
    args = parser.parse_args(argv)

    import ray

    from gyre_ray.cells.factories import ScriptedEngineFactory
    from gyre_ray.config import load_config
    from gyre_ray.proxy.launch import start_proxy

    ray.init(address="local", num_cpus=os.cpu_count() or 2, include_dashboard=False, logging_level="ERROR")
    records = tempfile.mkdtemp(prefix="bench-proxy-")
    overrides = [
        "cells.num_cells=2",
        "cells.cpus_per_cell=0.5",
        "proxy.port=0",
        f"proxy.records_dir={records}",
        f"proxy.store_max_records={args.sessions * args.turns * 4}",
    ]
    factory = None
    if args.engine == "scripted":
        factory = ScriptedEngineFactory(
            {"token_delay_s": args.token_delay_ms / 1e3, "reply_length": args.max_tokens}
        )
    config = load_config(None, overrides)
    handle = start_proxy(config, factory)
    try:
        measured = asyncio.run(run_all(handle, args, factory, config))
    finally:
        handle.shutdown()
        from ray import serve

        serve.shutdown()
        ray.shutdown()
    direct_p50 = measured["unloaded"]["direct"]["overhead_ms"]["p50"]
    result = {
        "benchmark": "proxy",
        "engine": args.engine,
        "token_delay_ms": args.token_delay_ms if args.engine == "scripted" else None,
        "max_tokens": args.max_tokens,
        "turns": args.turns,
        "client": args.client,
        "hardware": {"cpus": os.cpu_count(), "machine": platform.machine(), "python": sys.version.split()[0]},
        **measured,
        "target_overhead_p50_ms": 10.0,
        "target_met": direct_p50 <= 10.0,
    }
    RESULTS.mkdir(parents=True, exist_ok=True)
    out = RESULTS / f"proxy_cpu{os.cpu_count()}.json"
    out.write_text(json.dumps(result, indent=2) + "\n")
    report(result)
    print(f"saved {out}")
    errors = [p["errors"] for p in result["unloaded"].values()] + [
        p["errors"] for p in result["loaded"].values()
    ]
    return 0 if not any(errors) else 1


def report(result: dict) -> None:
    def line(name: str, phase: dict) -> str:
        o, m = phase["overhead_ms"], phase["overhead_ms_by_mode"]
        return (
            f"{name:34s} calls={phase['calls']:5d} errors={phase['errors']} calls/s={phase['calls_per_s']:7.1f} "
            f"e2e p50/p99={phase['e2e_ms']['p50']:.1f}/{phase['e2e_ms']['p99']:.1f} ms "
            f"overhead p50/p99={o['p50']:.1f}/{o['p99']:.1f} ms "
            f"(p50 stream {m['stream']['p50']:.1f}, non-stream {m['non_stream']['p50']:.1f})"
        )

    for route, phase in result["unloaded"].items():
        print(line(f"unloaded, {route}", phase))
    for route, phase in result["loaded"].items():
        print(line(f"loaded ({phase['sessions']} concurrent), {route}", phase))
    breakdown = result["breakdown"]
    for route, kinds in breakdown["ingress_alone"].items():
        print(
            f"ingress alone, {route:12s} GET p50 {kinds['get_health']['p50']:.2f} ms, "
            f"small POST p50 {kinds['post_count_tokens']['p50']:.2f} ms"
        )
    hop = breakdown["cell_hop"]
    print(
        f"cell hop (Ray call minus engine)  p50 non-stream {hop['non_stream']['p50']:.2f} ms, stream {hop['stream']['p50']:.2f} ms"
    )
    if "in_process_app" in breakdown:
        app = breakdown["in_process_app"]["overhead_ms_by_mode"]
        print(
            f"in-process app (no HTTP, no Ray)  p50 non-stream {app['non_stream']['p50']:.2f} ms, "
            f"stream {app['stream']['p50']:.2f} ms"
        )
    print(f"target: unloaded direct overhead p50 <= 10 ms: {'met' if result['target_met'] else 'NOT met'}")


if __name__ == "__main__":
    sys.exit(main())
