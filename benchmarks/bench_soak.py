"""Soak: many concurrent agent sessions through the proxy for a while, with drains and undrains; errors and memory.

    python benchmarks/bench_soak.py [--sessions 200] [--duration 600] [--turns 6] [--drain-every 3]

Starts a local Ray, two rollout cells (scripted engine: a fixed, CPU-free time per token, so the
figures are the proxy's and the cells' plumbing, not a model) and the proxy (`start_proxy`, one
replica, direct ingress). Each of `--sessions` concurrent sessions registers an execution, holds a
`--turns`-turn conversation (re-sending its history, so later calls splice recorded outputs),
finishes the execution (its records spill to disk) and starts the next, until `--duration` is up.
Every `--drain-every` seconds one cell is drained (its calls migrate) and undrained half a period
later. Reported: calls, HTTP status counts (any 5xx is a failure: no fault is injected), p50/p99
latency, and the resident memory of the proxy replica, each cell and the store, sampled every few
seconds: at the end of the warm-up (the first 10% of the run), at the middle and at the end. Memory
is bounded when the second half grows far less than the first. JSON: benchmarks/results/soak_cpu<cpus>.json.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import platform
import sys
import tempfile
import time
from collections import Counter
from pathlib import Path
from typing import Any

from bench_proxy import summary_ms

RESULTS = Path(__file__).resolve().parent / "results"
SAMPLE_S = 5.0


def rss_mb(pid: int) -> float | None:
    try:
        for line in Path(f"/proc/{pid}/status").read_text().splitlines():
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) / 1024
    except OSError:
        return None
    return None


def watched_processes() -> dict[str, int]:
    """Proxy replica, cells and store -> pid (from the GCS actor table of this private Ray)."""
    import ray

    found: dict[str, int] = {}
    for actor in ray._private.state.actors().values():
        if actor["State"] != "ALIVE":
            continue
        name = actor["Name"] or ""
        if name.startswith("SERVE_REPLICA::gyre-proxy"):
            found["proxy"] = actor["Pid"]
        elif name.startswith("cell-") or name == "store":
            found[name] = actor["Pid"]
    return found


class Soak:
    def __init__(self, handle: Any, args: argparse.Namespace) -> None:
        self.handle, self.args = handle, args
        self.statuses: Counter[str] = Counter()
        self.latencies: list[float] = []
        self.executions = 0
        self.drains = 0
        self.migrated = 0

    async def session(self, http: Any, deadline: float, index: int) -> None:
        admin = {"Authorization": f"Bearer {self.handle.admin_token}"}
        while time.monotonic() < deadline:
            async with http.post("/gyre/executions", json={}, headers=admin) as reply:
                created = await reply.json()
            self.executions += 1
            headers = {"Authorization": f"Bearer {created['api_key']}"}
            messages = [
                {"role": "system", "content": "You are an agent."},
                {"role": "user", "content": f"s{index}"},
            ]
            for turn in range(self.args.turns):
                body = {"model": "m", "messages": messages, "max_tokens": self.args.max_tokens}
                started = time.monotonic()
                async with http.post("/v1/chat/completions", json=body, headers=headers) as reply:
                    payload = await reply.json()
                    self.statuses[str(reply.status)] += 1
                self.latencies.append(time.monotonic() - started)
                if reply.status != 200:
                    await asyncio.sleep(float(reply.headers.get("retry-after", "1")))
                    continue
                text = payload["choices"][0]["message"]["content"] or ""
                messages += [
                    {"role": "assistant", "content": text},
                    {"role": "user", "content": f"tool {turn}"},
                ]
            async with http.post(
                f"/gyre/executions/{created['execution_id']}/finish", headers=admin
            ) as reply:
                self.statuses[f"finish_{reply.status}"] += 1

    async def drainer(self, http: Any, deadline: float) -> None:
        admin = {"Authorization": f"Bearer {self.handle.admin_token}"}
        period, k = self.args.drain_every, 0
        while time.monotonic() + period < deadline:
            await asyncio.sleep(period / 2)
            cell = self.handle.cell_ids[k % len(self.handle.cell_ids)]
            async with http.post(f"/gyre/cells/{cell}/drain", headers=admin) as reply:
                self.migrated += (await reply.json()).get("migrated", 0)
            self.drains += 1
            await asyncio.sleep(period / 2)
            async with http.post(f"/gyre/cells/{cell}/undrain", headers=admin) as reply:
                await reply.read()
            k += 1

    async def sampler(self, pids: dict[str, int], deadline: float, samples: list[dict[str, Any]]) -> None:
        t0 = time.monotonic()
        while time.monotonic() < deadline:
            samples.append(
                {"t_s": round(time.monotonic() - t0, 1), **{n: rss_mb(p) for n, p in pids.items()}}
            )
            await asyncio.sleep(SAMPLE_S)
        samples.append({"t_s": round(time.monotonic() - t0, 1), **{n: rss_mb(p) for n, p in pids.items()}})

    async def run(self, pids: dict[str, int]) -> list[dict[str, Any]]:
        import aiohttp

        connector = aiohttp.TCPConnector(limit=self.args.sessions)
        samples: list[dict[str, Any]] = []
        deadline = time.monotonic() + self.args.duration
        timeout = aiohttp.ClientTimeout(total=300)
        async with (
            aiohttp.ClientSession(self.handle.base_url, connector=connector, timeout=timeout) as http,
            aiohttp.ClientSession(self.handle.base_url, timeout=timeout) as admin,  # its own connection
        ):
            await asyncio.gather(
                self.sampler(pids, deadline, samples),
                self.drainer(admin, deadline),
                *(self.session(http, deadline, i) for i in range(self.args.sessions)),
            )
        return samples


def memory_report(samples: list[dict[str, Any]], duration: float) -> dict[str, Any]:
    """RSS at the end of the warm-up, the middle and the end; growth of each half (MB)."""
    names = [k for k in samples[0] if k != "t_s"]

    def at(t: float) -> dict[str, Any]:
        return min(samples, key=lambda s: abs(s["t_s"] - t))

    warm, mid, end = at(0.1 * duration), at(0.55 * duration), samples[-1]
    report: dict[str, Any] = {}
    for name in names:
        values = [s[name] for s in (warm, mid, end)]
        if None in values:
            report[name] = {"missing": True}
            continue
        report[name] = {
            "warm_mb": round(values[0], 1),
            "mid_mb": round(values[1], 1),
            "end_mb": round(values[2], 1),
            "first_half_growth_mb": round(values[1] - values[0], 1),
            "second_half_growth_mb": round(values[2] - values[1], 1),
            "peak_mb": round(max(s[name] for s in samples if s[name] is not None), 1),
        }
    return report


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--sessions", type=int, default=200)
    parser.add_argument("--duration", type=float, default=600.0)
    parser.add_argument("--turns", type=int, default=6)
    parser.add_argument("--max-tokens", type=int, default=16)
    parser.add_argument("--drain-every", type=float, default=3.0)
    parser.add_argument("--token-delay-s", type=float, default=0.002)
    parser.add_argument("--out", type=Path, default=None)
    args = parser.parse_args(argv)

    import ray
    from ray import serve

    from gyre_ray.cells.factories import ScriptedEngineFactory
    from gyre_ray.config import load_config
    from gyre_ray.proxy.launch import start_proxy

    cpus = os.cpu_count() or 1
    folder = Path(tempfile.mkdtemp(prefix="gyre-soak-"))
    ray.init(address="local", num_cpus=cpus, include_dashboard=False, logging_level="WARNING")
    overrides = [
        "cells.num_cells=2",
        "cells.cpus_per_cell=0.5",
        "proxy.port=0",
        f"proxy.records_dir={folder}",
    ]
    cfg = load_config(str(Path(__file__).resolve().parents[1] / "jobs/configs/toy.yaml"), overrides)
    factory = ScriptedEngineFactory({"reply_length": args.max_tokens, "token_delay_s": args.token_delay_s})
    handle = start_proxy(cfg, factory, timeout_s=300)
    try:
        soak = Soak(handle, args)
        pids = watched_processes()
        started = time.monotonic()
        samples = asyncio.run(soak.run(pids))
        wall = time.monotonic() - started
        stats = handle.stats()
    finally:
        handle.shutdown()
        serve.shutdown()
        ray.shutdown()
    calls = sum(n for s, n in soak.statuses.items() if not s.startswith("finish_"))
    errors_5xx = sum(n for s, n in soak.statuses.items() if s.removeprefix("finish_").startswith("5"))
    result = {
        "machine": {"cpus": cpus, "python": platform.python_version()},
        "args": {k: (str(v) if isinstance(v, Path) else v) for k, v in vars(args).items()},
        "wall_s": round(wall, 1),
        "calls": calls,
        "calls_per_s": round(calls / wall, 1),
        "executions": soak.executions,
        "statuses": dict(soak.statuses),
        "errors_5xx": errors_5xx,
        "latency_ms": summary_ms(soak.latencies),
        "drains": soak.drains,
        "calls_migrated_by_drains": soak.migrated,
        "proxy_counters": stats["proxy"],
        "store": stats["store"],
        "memory": memory_report(samples, args.duration),
        "rss_samples": samples,
    }
    out = args.out or RESULTS / f"soak_cpu{cpus}.json"
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(result, indent=1) + "\n")
    print(json.dumps({k: v for k, v in result.items() if k != "rss_samples"}, indent=1))
    print(f"saved {out}")
    return 0 if errors_5xx == 0 else 1


if __name__ == "__main__":
    sys.exit(main())
