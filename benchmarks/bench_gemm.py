"""The inference GEMM kinds side by side: gyre-ray's native kernel, MKL's packed sgemm, oneDNN, `F.linear`.

For each row count (a decode batch of 1-64 requests up to a 1,024-token prefill) every kind runs
the `m61` model's five projection shapes (fused q/k/v, o, fused gate/up, down, LM head; the shapes
one decode step multiplies), float32, 1 torch thread, interleaved, best of `--repeats` rounds of
`--calls` calls. Prints GFLOP/s and the step's total ms per kind, beside the core's float32 FMA
peak (the native library's register-only FMA loop: the compute roofline), and saves
`benchmarks/results/gemm_cpu<cores>.json`.

Usage: python benchmarks/bench_gemm.py [--rows 1,2,4,8,16,32,64,256,1024] [--repeats 5]
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import time
from collections.abc import Callable
from pathlib import Path

import torch
import torch.nn.functional as F

from gyre_ray.model import native_gemm, packed_linear

HIDDEN, HEADS, KV_HEADS, HEAD_DIM, INTERMEDIATE, VOCAB = 768, 12, 4, 64, 2304, 8192
SHAPES = {  # (N, K) of y = x @ W.T
    "qkv": ((HEADS + 2 * KV_HEADS) * HEAD_DIM, HIDDEN),
    "o": (HIDDEN, HEADS * HEAD_DIM),
    "gate_up": (2 * INTERMEDIATE, HIDDEN),
    "down": (HIDDEN, INTERMEDIATE),
    "lm_head": (VOCAB, HIDDEN),
}


def kinds(weight: torch.Tensor, rows: int) -> dict[str, Callable[[torch.Tensor], torch.Tensor]]:
    """Each available GEMM of `x @ weight.T`, packed for `rows` rows the way the engine packs it."""
    out: dict[str, Callable[[torch.Tensor], torch.Tensor]] = {"f_linear": lambda x: F.linear(x, weight)}
    available = {
        "native": native_gemm.library() is not None,
        "mkl_packed": packed_linear._mkl_supported(),
        "onednn": packed_linear.packing_supported(weight),
    }
    for name, ok in available.items():
        if ok:
            fused = packed_linear.PackedLinear([], rows)
            fused.splits = [weight.size(0)]
            fused._pack(name.removesuffix("_packed"), weight)
            out[name] = fused._gemm
    return out


def sweep(rows: int, repeats: int, calls: int) -> dict:
    gen = torch.Generator().manual_seed(rows)
    totals: dict[str, float] = {}
    shapes = {}
    for name, (n, k) in SHAPES.items():
        weight, x = torch.randn(n, k, generator=gen), torch.randn(rows, k, generator=gen)
        fns = kinds(weight, rows)
        reference = F.linear(x, weight)
        best = dict.fromkeys(fns, float("inf"))
        for _ in range(repeats):  # interleaved: load from elsewhere hits every kind alike
            for kind, fn in fns.items():
                fn(x)
                start = time.perf_counter()
                for _ in range(calls):
                    fn(x)
                best[kind] = min(best[kind], (time.perf_counter() - start) / calls)
        errors = {
            kind: float((fn(x) - reference).abs().max() / reference.abs().max()) for kind, fn in fns.items()
        }
        flops = 2 * rows * n * k
        shapes[name] = {
            "n": n,
            "k": k,
            "gflops": {kind: round(flops / s / 1e9, 2) for kind, s in best.items()},
            "max_rel_error_vs_f_linear": {kind: float(f"{e:.2e}") for kind, e in errors.items()},
        }
        for kind, seconds in best.items():
            totals[kind] = totals.get(kind, 0.0) + seconds
    step_ms = {kind: round(1000 * s, 3) for kind, s in totals.items()}
    fastest_other = min(v for k, v in step_ms.items() if k != "native") if "native" in step_ms else None
    flops = sum(2 * rows * n * k for n, k in SHAPES.values())
    return {
        "rows": rows,
        "all_shapes_ms": step_ms,
        "all_shapes_gflops": {kind: round(flops / ms / 1e6, 2) for kind, ms in step_ms.items()},
        "native_speedup_vs_best_other": round(fastest_other / step_ms["native"], 3)
        if fastest_other
        else None,
        "shapes": shapes,
    }


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rows", default="1,2,4,8,16,32,64,256,1024")
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--calls", type=int, default=10)
    parser.add_argument("--out", default=str(Path(__file__).parent / "results"))
    opts = parser.parse_args(argv)
    torch.set_num_threads(1)
    result = {
        "benchmark": "gemm",
        "hardware": f"cpu{os.cpu_count()}",
        "platform": platform.platform(),
        "processor": _cpu_model(),
        "torch": torch.__version__,
        "torch_threads": 1,
        "native_gemm": native_gemm.reason(),
        "fma_peak_gflops": _round(native_gemm.fma_peak_gflops()),
        "load_average_start": list(os.getloadavg()),
        "sweeps": [],
    }
    print(f"native GEMM: {result['native_gemm']}; FMA peak {result['fma_peak_gflops']} GFLOP/s", flush=True)
    for rows in (int(r) for r in opts.rows.split(",")):
        row = sweep(rows, opts.repeats, max(1, opts.calls * 16 // max(rows, 16)))
        result["sweeps"].append(row)
        cells = "  ".join(f"{kind} {ms:9.3f} ms" for kind, ms in row["all_shapes_ms"].items())
        print(f"rows {rows:5d}: {cells}  native x{row['native_speedup_vs_best_other']}", flush=True)
    result["load_average_end"] = list(os.getloadavg())
    out = Path(opts.out) / f"gemm_cpu{os.cpu_count()}.json"
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(result, indent=1) + "\n")
    print(f"saved {out}")
    return 0


def _round(value: float | None) -> float | None:
    return None if value is None else round(value, 2)


def _cpu_model() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor()


if __name__ == "__main__":
    raise SystemExit(main())
