"""Transfer backends side by side: publishing weights from one Ray actor (the core) to another (a cell).

For each payload (the tiny model's state dict; a synthetic ~200 MB state of 4 MiB float32 tensors)
and each backend (Ray object store, Mooncake TCP on loopback, ray.util.collective gloo broadcast):
stage seconds on the sender, fetch seconds on the receiver (the transfer itself plus rebuilding the
tensors), GiB/s of the fetch, and its ratio to a local memcpy of the same bytes measured in the
receiver's process in the same run. Every delivery is checked bit for bit (CRC-32 per tensor).
Median of `--rounds` interleaved rounds.

Usage: python benchmarks/bench_transfer.py [--rounds 3] [--mib 200] [--out benchmarks/results]
Saves transfer_cpu<cores>.json under the output folder.
"""

from __future__ import annotations

import argparse
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
from gyre_ray.transfer.config import TransferSection  # noqa: E402
from gyre_ray.transfer.layout import tensor_checksums  # noqa: E402
from gyre_ray.transfer.mooncake import mooncake_available  # noqa: E402


@ray.remote(num_cpus=0)
class End:
    def __init__(self, backend: str, owner: str) -> None:
        self.transport = make_transport(backend, TransferSection(verify_checksums=False), owner=owner)
        self.payloads: dict[str, Any] = {}

    def join(self, world: int, rank: int) -> None:
        self.transport.join(world, rank)

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

    def push(self, ticket: Any) -> None:
        self.transport.push(ticket)
        self.transport.release(ticket)

    def fetch(self, ticket: Any) -> tuple[float, tuple[int, ...]]:
        start = time.perf_counter()
        state = self.transport.fetch(ticket)
        elapsed = time.perf_counter() - start
        return elapsed, tensor_checksums(list(state.values()))

    def checksums(self, name: str) -> tuple[int, ...]:
        return tensor_checksums(list(self.payloads[name].values()))

    def memcpy_s(self, nbytes: int) -> float:
        src = torch.empty(nbytes, dtype=torch.uint8).fill_(1)
        dst = torch.empty_like(src)
        dst.copy_(src)  # warm
        start = time.perf_counter()
        dst.copy_(src)
        return time.perf_counter() - start


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--mib", type=int, default=200)
    parser.add_argument("--out", default=str(Path(__file__).parent / "results"))
    a = parser.parse_args()
    ray.init(address="local", num_cpus=2, include_dashboard=False, logging_level="WARNING")
    backends = ["object_store", "collective"]
    ok, why = mooncake_available()
    if ok:
        backends.insert(1, "mooncake")
    else:
        print(f"mooncake skipped: {why}")
    ends = {}
    for backend in backends:
        ends[backend] = [End.remote(backend, f"cell-{i}") for i in range(2)]
        if backend == "collective":
            ray.get([e.join.remote(2, i) for i, e in enumerate(ends[backend])])
    payloads = {}
    for name in ("tiny-model", "synthetic"):
        sizes = {ray.get(s.make.remote(name, a.mib)) for s, _ in ends.values()}
        (payloads[name],) = sizes
    raw: dict[tuple[str, str], dict[str, list[float]]] = {}
    for r in range(a.rounds):
        for name, nbytes in payloads.items():
            for backend, (sender, receiver) in ends.items():
                ticket, stage_s = ray.get(sender.stage.remote(name, r + 1))
                (fetch_s, sums), _ = ray.get([receiver.fetch.remote(ticket), sender.push.remote(ticket)])
                if sums != ray.get(sender.checksums.remote(name)):
                    raise SystemExit(f"{backend}: {name} arrived with different bytes")
                memcpy_s = ray.get(receiver.memcpy_s.remote(nbytes))
                row = raw.setdefault((name, backend), {"stage_s": [], "fetch_s": [], "memcpy_s": []})
                row["stage_s"].append(stage_s)
                row["fetch_s"].append(fetch_s)
                row["memcpy_s"].append(memcpy_s)
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
    }
    out.write_text(json.dumps({"meta": meta, "results": results}, indent=2) + "\n")
    print(f"saved {out}")


if __name__ == "__main__":
    main()
