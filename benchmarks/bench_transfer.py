"""Transfer backends side by side: publishing weights from one Ray actor (the core) to another (a cell).

For each payload (the tiny model's state dict; a synthetic ~200 MB state of 4 MiB float32 tensors)
and each backend (Ray object store, Mooncake TCP on loopback, ray.util.collective gloo broadcast):
stage seconds on the sender, fetch seconds on the receiver (the transfer itself plus rebuilding the
tensors; for collectives, the broadcast on the sender, group set-up and tear-down included, plus the
receiver's rebuild), GiB/s of the fetch, and its ratio to a local memcpy of the same bytes measured in the
receiver's process in the same run. Every delivery is checked bit for bit (CRC-32 per tensor).
Median of `--rounds` interleaved rounds.

Then a session's KV on drain: a 20-turn agent session on one tiny-model cell (in this process),
the cell drained, the session's next call on another cell with its staged prefix (fetched through
the KV transport, `transfer.kv`) and without it: bytes moved, seconds to fetch and import, and
prompt tokens the next call prefilled (and their share of its prompt). The machine's load (`uptime`) is recorded before and after.

Usage: python benchmarks/bench_transfer.py [--rounds 3] [--mib 200] [--out benchmarks/results]
Saves transfer_cpu<cores>.json under the output folder.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import platform
import statistics
import time
from pathlib import Path
from typing import Any

os.environ.setdefault("GLOG_minloglevel", "2")  # Mooncake's INFO lines

import ray  # noqa: E402
import torch  # noqa: E402

from gyre_ray.model.arch import ModelArgs  # noqa: E402
from gyre_ray.model.config import ModelSection  # noqa: E402
from gyre_ray.transfer import make_transport  # noqa: E402
from gyre_ray.transfer.collective import CollectiveHost  # noqa: E402
from gyre_ray.transfer.config import TransferSection  # noqa: E402
from gyre_ray.transfer.layout import tensor_checksums  # noqa: E402
from gyre_ray.transfer.mooncake import mooncake_available  # noqa: E402


class _End:
    def __init__(self, backend: str, owner: str) -> None:
        self.transport = make_transport(backend, TransferSection(verify_checksums=False), owner=owner)
        self.payloads: dict[str, Any] = {}

    def connect(self, peers: list[str]) -> None:
        self.transport.connect(self.transport.owner, None, peers)

    def make(self, name: str, mib: int) -> int:
        if name == "tiny-model":
            from gyre_ray.model.qwen3 import Qwen3ForCausalLM, init_weights

            args = ModelArgs.preset(ModelSection().preset)
            self.payloads[name] = init_weights(Qwen3ForCausalLM(args), 0).state_dict()
        else:
            n = max(1, mib // 4)
            self.payloads[name] = {f"t{i}": torch.randn(1 << 20) for i in range(n)}
        return sum(t.numel() * t.element_size() for t in self.payloads[name].values())

    def stage(self, name: str, version: int) -> tuple[Any, float]:
        start = time.perf_counter()
        ticket = self.transport.stage(self.payloads[name], kind="weights", version=version)
        return ticket, time.perf_counter() - start

    def push(self, ticket: Any) -> float:
        """Collectives: the broadcast (a group formed for it, the bytes sent, the group torn down)."""
        start = time.perf_counter()
        self.transport.push(ticket)
        return time.perf_counter() - start

    def release(self, ticket: Any) -> None:
        self.transport.release(ticket)

    def fetch(self, ticket: Any) -> tuple[float, tuple[int, ...]]:
        start = time.perf_counter()
        state = self.transport.fetch(ticket)
        elapsed = time.perf_counter() - start
        return elapsed, tensor_checksums(list(state.values()))

    def object_store_split(self, ticket: Any) -> dict[str, float]:
        """Where an object-store fetch spends its time: `ray.get` (plasma maps the bytes), then the copy
        out of plasma into fresh memory (what `fetch` does: every page faults once) or into memory
        touched before (as a pooled receive buffer would be)."""
        import numpy as np

        (ref,) = ticket.address["ref"]
        start = time.perf_counter()
        array = ray.get(ref)
        get_s = time.perf_counter() - start
        start = time.perf_counter()
        fresh = np.array(array, copy=True)
        fresh_s = time.perf_counter() - start
        touched = np.ones_like(fresh)
        start = time.perf_counter()
        np.copyto(touched, array)
        touched_s = time.perf_counter() - start
        return {"get_s": get_s, "copy_fresh_s": fresh_s, "copy_touched_s": touched_s}

    def checksums(self, name: str) -> tuple[int, ...]:
        return tensor_checksums(list(self.payloads[name].values()))

    def memcpy_s(self, nbytes: int) -> float:
        src = torch.empty(nbytes, dtype=torch.uint8).fill_(1)
        dst = torch.empty_like(src)
        dst.copy_(src)  # warm
        start = time.perf_counter()
        dst.copy_(src)
        return time.perf_counter() - start


End = ray.remote(num_cpus=0)(_End)


@ray.remote(num_cpus=0)
class CollectiveEnd(_End, CollectiveHost):
    def _collective(self) -> Any:
        return self.transport


def _load() -> str:
    """The 1, 5 and 15 minute load averages (what `uptime` prints)."""
    path = Path("/proc/loadavg")
    return " ".join(path.read_text().split()[:3]) if path.exists() else "unknown"


async def _session_kv(turns: int = 20, new_tokens: int = 24, reply: int = 16) -> dict[str, Any]:
    """A `turns`-turn session on cell A, A drained; its next call on B with and without the staged KV."""
    from gyre_ray.cells.cell import RolloutCell, TokenBatch
    from gyre_ray.cells.factories import PolicyEngineFactory
    from gyre_ray.engines.base import GenerateRequest, SamplingParams

    factory = PolicyEngineFactory(engine={"prefix_cache_tokens": 1 << 20})
    a, b, c = (RolloutCell(f"cell-{i}", factory) for i in range(3))
    for cell in (a, b, c):
        await cell.setup()
    greedy = SamplingParams(temperature=0.0, max_new_tokens=reply, stop_token_ids=[])

    async def call(cell: RolloutCell, rid: str, ids: list[int], prefix: Any = None) -> list[int]:
        out: list[int] = []
        async for event in cell.generate(GenerateRequest(rid, ids, greedy), "s", prefix):
            if isinstance(event, TokenBatch):
                out.extend(e.token_id for e in event.events)
        return out

    context: list[int] = []
    for turn in range(turns):
        context += [(97 * turn + 13 * j) % 8000 + 100 for j in range(new_tokens)]
        context += await call(a, f"s/{turn}", list(context))
    started = time.perf_counter()
    await a.drain()  # exports and stages the waiting session's cached prefix
    drain_s = time.perf_counter() - started
    ticket = await a.take_session("s")
    nxt = context + [(31 * j) % 8000 + 100 for j in range(new_tokens)]
    results = {}
    for name, cell, prefix in (("migrated", b, ticket), ("re-prefill", c, None)):
        before = cell.status()["engine"]
        started = time.perf_counter()  # the migrated call includes fetching and importing the prefix
        out = await call(cell, f"s/{turns}", nxt, prefix)
        seconds = time.perf_counter() - started
        after = cell.status()["engine"]
        results[name] = {
            "prefill_tokens": after["prefill_computed_tokens"] - before["prefill_computed_tokens"],
            "call_s": seconds,
            "output": out,
        }
    for cell in (a, b, c):
        cell.close()
    same = results["migrated"].pop("output") == results["re-prefill"].pop("output")
    for row in results.values():  # the share of the next call's prompt its engine computed again
        row["recomputed_share"] = row["prefill_tokens"] / len(nxt)
    return {
        "turns": turns,
        "prompt_tokens": len(nxt),
        "kv_bytes": ticket.nbytes,
        "kv_backend": ticket.backend,
        "drain_stage_s": drain_s,
        "greedy_output_same": same,
        **{f"{name}_{k}": v for name, row in results.items() for k, v in row.items()},
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--mib", type=int, default=200)
    parser.add_argument("--out", default=str(Path(__file__).parent / "results"))
    a = parser.parse_args()
    load_before = _load()
    ray.init(address="local", num_cpus=2, include_dashboard=False, logging_level="WARNING")
    backends = ["object_store", "collective"]
    ok, why = mooncake_available()
    if ok:
        backends.insert(1, "mooncake")
    else:
        print(f"mooncake skipped: {why}")
    ends = {}
    for backend in backends:
        if backend == "collective":
            names = ["cell-0", "cell-1"]
            ends[backend] = [CollectiveEnd.options(name=n).remote(backend, n) for n in names]
            ray.get([e.connect.remote(names) for e in ends[backend]])
        else:
            ends[backend] = [End.remote(backend, f"cell-{i}") for i in range(2)]
    payloads = {}
    for name in ("tiny-model", "synthetic"):
        sizes = {ray.get(s.make.remote(name, a.mib)) for s, _ in ends.values()}
        (payloads[name],) = sizes
    raw: dict[tuple[str, str], dict[str, list[float]]] = {}
    for r in range(a.rounds):
        for name, nbytes in payloads.items():
            for backend, (sender, receiver) in ends.items():
                ticket, stage_s = ray.get(sender.stage.remote(name, r + 1))
                push_s = ray.get(sender.push.remote(ticket))  # collectives: the broadcast; else a no-op
                fetch_s, sums = ray.get(receiver.fetch.remote(ticket))
                fetch_s += push_s if backend == "collective" else 0.0
                ray.get(sender.release.remote(ticket))
                if sums != ray.get(sender.checksums.remote(name)):
                    raise SystemExit(f"{backend}: {name} arrived with different bytes")
                memcpy_s = ray.get(receiver.memcpy_s.remote(nbytes))
                row = raw.setdefault((name, backend), {"stage_s": [], "fetch_s": [], "memcpy_s": []})
                row["stage_s"].append(stage_s)
                row["fetch_s"].append(fetch_s)
                row["memcpy_s"].append(memcpy_s)
                if backend == "object_store":
                    for k, v in ray.get(receiver.object_store_split.remote(ticket)).items():
                        row.setdefault(k, []).append(v)
    results = []
    print(
        f"{'payload':<11} {'backend':<13} {'MiB':>7} {'stage s':>8} {'fetch s':>8} {'GiB/s':>7} {'memcpy GiB/s':>13} {'vs memcpy':>9}"
    )
    for (name, backend), row in raw.items():
        nbytes = payloads[name]
        med = {k: statistics.median(v) for k, v in row.items()}
        gibs = nbytes / med["fetch_s"] / 2**30
        mem_gibs = nbytes / med["memcpy_s"] / 2**30
        results.append(
            {
                "payload": name,
                "backend": backend,
                "bytes": nbytes,
                **med,
                "fetch_gib_s": gibs,
                "memcpy_gib_s": mem_gibs,
                "ratio_to_memcpy": gibs / mem_gibs,
                "bit_exact": True,
            }
        )
        print(
            f"{name:<11} {backend:<13} {nbytes / 2**20:>7.1f} {med['stage_s']:>8.3f} {med['fetch_s']:>8.3f} "
            f"{gibs:>7.2f} {mem_gibs:>13.2f} {gibs / mem_gibs:>9.2f}"
        )
        if "copy_fresh_s" in med:
            print(
                f"{'':<11} {'  its split':<13} ray.get {med['get_s']:.3f} s, copy out of plasma into fresh "
                f"memory {nbytes / med['copy_fresh_s'] / 2**30:.2f} GiB/s, into touched memory "
                f"{nbytes / med['copy_touched_s'] / 2**30:.2f} GiB/s"
            )
    session = asyncio.run(_session_kv())
    print(
        f"session KV on drain ({session['turns']} turns, next prompt {session['prompt_tokens']} tokens): "
        f"{session['kv_bytes'] / 2**20:.2f} MiB via {session['kv_backend']}, staged in {session['drain_stage_s']:.3f} s; "
        f"next call prefilled {session['migrated_prefill_tokens']} tokens "
        f"({session['migrated_recomputed_share']:.1%} of its prompt, {session['migrated_call_s']:.3f} s) "
        f"against {session['re-prefill_prefill_tokens']} ({session['re-prefill_recomputed_share']:.1%}, "
        f"{session['re-prefill_call_s']:.3f} s) without; "
        f"same greedy output: {session['greedy_output_same']}"
    )
    ray.shutdown()
    tag = f"cpu{os.cpu_count()}"
    out = Path(a.out) / f"transfer_{tag}.json"
    out.parent.mkdir(parents=True, exist_ok=True)
    meta = {
        "machine": platform.machine(),
        "cpus": os.cpu_count(),
        "torch": torch.__version__,
        "rounds": a.rounds,
        "note": "fetch = transfer + rebuilding tensors in the receiver; memcpy = one copy of the same bytes there",
        "load_average_before": load_before,
        "load_average_after": _load(),
    }
    out.write_text(json.dumps({"meta": meta, "results": results, "session_kv": session}, indent=2) + "\n")
    print(f"saved {out}")


if __name__ == "__main__":
    main()
