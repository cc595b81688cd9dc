"""Proxy benchmark: many concurrent multi-turn sessions through Ray Serve; errors and the proxy's own overhead.

    python benchmarks/bench_proxy.py [--sessions 200] [--turns 5] [--engine scripted|tiny]

Starts a local Ray, two rollout cells and the proxy (`start_proxy`). Each session registers an
execution and holds a `--turns`-turn conversation (odd turns streamed), re-sending its history, so
every call after the first splices recorded outputs. Per call, overhead = client end-to-end latency
minus the time the call spent inside its cell's engine (the record's `meta.engine_s`). Reported:
errors, calls/s, end-to-end and overhead p50 / p99, once unloaded (one session at a time) and once
with all sessions concurrent, next to the Serve ingress baseline (a POST that reaches the replica
and returns without touching a cell: Serve's HTTP proxy actor fetches request bodies from the
replica's side with an extra actor call, a cost of Serve, not of gyre-ray). The default scripted engine spends a fixed, CPU-free time per token,
so the figures isolate the proxy; `--engine tiny` runs the tiny model instead.
Results are printed and saved to benchmarks/results/proxy-<cpus>cpu.json.
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

import httpx

RESULTS = Path(__file__).resolve().parent / "results"


def percentile(values: list[float], q: float) -> float:
    if not values:
        return float("nan")
    ordered = sorted(values)
    index = min(len(ordered) - 1, max(0, round(q / 100 * (len(ordered) - 1))))
    return ordered[index]


async def session(
    client: httpx.AsyncClient, admin: dict, turns: int, max_tokens: int, timings: dict, errors: list
):
    created = (await client.post("/gyre/executions", headers=admin, json={})).json()
    headers = {"Authorization": f"Bearer {created['api_key']}"}
    messages = [{"role": "system", "content": "You are a benchmark agent."}]
    for turn in range(turns):
        messages.append({"role": "user", "content": f"turn {turn}: continue the work."})
        body = {
            "model": "m",
            "messages": messages,
            "max_tokens": max_tokens,
            "temperature": 0,
            "stream": turn % 2 == 1,
        }
        start = time.perf_counter()
        try:
            if body["stream"]:
                text, call_id = "", None
                async with client.stream(
                    "POST", "/v1/chat/completions", json=body, headers=headers
                ) as response:
                    if response.status_code != 200:
                        raise RuntimeError(
                            f"status {response.status_code}: {(await response.aread())[:200]!r}"
                        )
                    async for line in response.aiter_lines():
                        if line.startswith("data: {"):
                            chunk = json.loads(line[6:])
                            if "error" in chunk:
                                raise RuntimeError(chunk["error"]["message"])
                            call_id = chunk["id"]
                            if chunk["choices"]:
                                text += chunk["choices"][0]["delta"].get("content") or ""
            else:
                response = await client.post("/v1/chat/completions", json=body, headers=headers)
                if response.status_code != 200:
                    raise RuntimeError(f"status {response.status_code}: {response.text[:200]}")
                reply = response.json()
                text, call_id = reply["choices"][0]["message"]["content"], reply["id"]
        except Exception as exc:
            errors.append(f"{type(exc).__name__}: {exc}")
            return created["execution_id"]
        timings[call_id.removeprefix("chatcmpl-")] = (time.perf_counter() - start, body["stream"])
        messages.append({"role": "assistant", "content": text})
    return created["execution_id"]


async def ingress_baseline(base_url: str, admin_token: str, calls: int = 50) -> dict:
    """Serve ingress alone: a POST with a small JSON body whose handler makes no engine or actor call."""
    admin = {"Authorization": f"Bearer {admin_token}"}
    async with httpx.AsyncClient(base_url=base_url, timeout=60) as client:
        key = (await client.post("/gyre/executions", headers=admin, json={})).json()["api_key"]
        body = {"model": "m", "messages": [{"role": "user", "content": "hi"}]}
        times = []
        for _ in range(calls):
            start = time.perf_counter()
            response = await client.post("/v1/messages/count_tokens", json=body, headers={"x-api-key": key})
            times.append(time.perf_counter() - start)
            response.raise_for_status()
    return {
        "calls": calls,
        "p50_ms": round(percentile(times, 50) * 1e3, 2),
        "p99_ms": round(percentile(times, 99) * 1e3, 2),
    }


async def run_phase(
    base_url: str, admin_token: str, sessions: int, turns: int, max_tokens: int, concurrent: bool
):
    admin = {"Authorization": f"Bearer {admin_token}"}
    limits = httpx.Limits(max_connections=sessions + 8, max_keepalive_connections=sessions + 8)
    timings: dict[str, float] = {}
    errors: list[str] = []
    async with httpx.AsyncClient(base_url=base_url, timeout=600, limits=limits) as client:
        start = time.perf_counter()
        if concurrent:
            executions = await asyncio.gather(
                *(session(client, admin, turns, max_tokens, timings, errors) for _ in range(sessions))
            )
        else:
            executions = [
                await session(client, admin, turns, max_tokens, timings, errors) for _ in range(sessions)
            ]
        wall = time.perf_counter() - start
        engine: dict[str, float] = {}
        for execution_id in executions:
            text = (await client.get(f"/gyre/executions/{execution_id}/records", headers=admin)).text
            for line in text.splitlines():
                record = json.loads(line)
                engine[record["call_id"]] = record["meta"]["engine_s"]
    e2e = [t for t, _ in timings.values()]
    overhead = [t - engine[c] for c, (t, _) in timings.items() if c in engine]
    by_mode = {
        mode: [
            t - engine[c]
            for c, (t, streamed) in timings.items()
            if c in engine and streamed == (mode == "stream")
        ]
        for mode in ("stream", "non_stream")
    }
    return {
        "sessions": sessions,
        "turns": turns,
        "concurrent": concurrent,
        "calls": len(timings),
        "errors": len(errors),
        "error_examples": errors[:5],
        "missing_records": sum(1 for c in timings if c not in engine),
        "wall_s": round(wall, 3),
        "calls_per_s": round(len(timings) / wall, 2),
        "e2e_ms": {"p50": round(percentile(e2e, 50) * 1e3, 2), "p99": round(percentile(e2e, 99) * 1e3, 2)},
        "overhead_ms": {
            "p50": round(percentile(overhead, 50) * 1e3, 2),
            "p99": round(percentile(overhead, 99) * 1e3, 2),
            "mean": round(statistics.fmean(overhead) * 1e3, 2) if overhead else None,
        },
        "overhead_p50_ms_by_mode": {mode: round(percentile(v, 50) * 1e3, 2) for mode, v in by_mode.items()},
    }


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--sessions", type=int, default=200)
    parser.add_argument("--turns", type=int, default=5)
    parser.add_argument("--max-tokens", type=int, default=16)
    parser.add_argument("--engine", choices=["scripted", "tiny"], default="scripted")
    parser.add_argument("--token-delay-ms", type=float, default=2.0, help="scripted engine time per token")
    parser.add_argument("--unloaded-sessions", type=int, default=20)
    args = parser.parse_args(argv)

    import ray

    from gyre_ray.cells.factories import ScriptedEngineFactory
    from gyre_ray.config import load_config
    from gyre_ray.proxy.launch import start_proxy

    ray.init(address="local", num_cpus=os.cpu_count() or 2, include_dashboard=False, logging_level="ERROR")
    records = tempfile.mkdtemp(prefix="bench-proxy-")
    overrides = [
        "proxy.num_cells=2",
        "proxy.cpus_per_cell=0.5",
        "proxy.port=0",
        f"proxy.records_dir={records}",
    ]
    overrides.append(f"proxy.store_max_records={args.sessions * args.turns * 2}")
    factory = None
    if args.engine == "scripted":
        factory = ScriptedEngineFactory(
            {"token_delay_s": args.token_delay_ms / 1e3, "reply_length": args.max_tokens}
        )
    handle = start_proxy(load_config(None, overrides), factory)
    try:
        baseline = asyncio.run(ingress_baseline(handle.base_url, handle.admin_token))
        unloaded = asyncio.run(
            run_phase(
                handle.base_url,
                handle.admin_token,
                args.unloaded_sessions,
                args.turns,
                args.max_tokens,
                False,
            )
        )
        loaded = asyncio.run(
            run_phase(handle.base_url, handle.admin_token, args.sessions, args.turns, args.max_tokens, True)
        )
    finally:
        handle.shutdown()
        from ray import serve

        serve.shutdown()
        ray.shutdown()
    result = {
        "benchmark": "proxy",
        "engine": args.engine,
        "token_delay_ms": args.token_delay_ms if args.engine == "scripted" else None,
        "max_tokens": args.max_tokens,
        "hardware": {"cpus": os.cpu_count(), "machine": platform.machine(), "python": sys.version.split()[0]},
        "ingress_baseline": baseline,
        "unloaded": unloaded,
        "loaded": loaded,
        "target_overhead_p50_ms": 10.0,
    }
    RESULTS.mkdir(parents=True, exist_ok=True)
    out = RESULTS / f"proxy-{os.cpu_count()}cpu.json"
    out.write_text(json.dumps(result, indent=2) + "\n")
    for name, phase in (
        ("unloaded (sequential)", unloaded),
        (f"loaded ({args.sessions} concurrent)", loaded),
    ):
        print(
            f"{name:28s} calls={phase['calls']:5d} errors={phase['errors']} calls/s={phase['calls_per_s']:7.1f} "
            f"e2e p50/p99={phase['e2e_ms']['p50']:.1f}/{phase['e2e_ms']['p99']:.1f} ms "
            f"overhead p50/p99={phase['overhead_ms']['p50']:.1f}/{phase['overhead_ms']['p99']:.1f} ms "
            f"(p50 stream {phase['overhead_p50_ms_by_mode']['stream']:.1f}, "
            f"non-stream {phase['overhead_p50_ms_by_mode']['non_stream']:.1f})"
        )
    print(
        f"serve ingress baseline (POST, no engine): p50 {baseline['p50_ms']:.1f} ms, p99 {baseline['p99_ms']:.1f} ms"
    )
    print(f"saved {out}")
    return 0 if loaded["errors"] == 0 and unloaded["errors"] == 0 else 1


if __name__ == "__main__":
    sys.exit(main())
