"""gyre-ray's own float32 CPU GEMM for inference (`native/small_gemm.c`), built with the system C compiler.

On a few rows (a decode step: one row per running request) MKL's sgemm, packed or not, runs at a
half or less of what one AVX2 core can do; the kernel here keeps 12 accumulators in registers
over weights packed in 8-column panels and runs rows in L2-sized chunks. On this project's 2-core
AVX2 machine it is 1.1-1.7x the better of MKL's packing and oneDNN at 2-64 rows and 1.03x at 1,024
(83% and 94% of the core's FMA peak at 16 and 1,024 rows; `benchmarks/bench_gemm.py`,
docs/engine.md). It runs on one thread: `PackedLinear` races it against MKL and oneDNN once per
weight shape, takes it only while torch runs on one intra-op thread (what Ray gives an actor) and
leaves several threads to MKL.

The library is compiled once per machine on first use (`cc -O3 -shared -fPIC`, under a second)
into `$GYRE_NATIVE_CACHE` or `~/.cache/gyre-ray/native/<hash of source, compiler and flags>/`,
written under a temporary name and renamed, so processes that start together never load half a
file. Where it cannot be used (not x86-64 Linux, no compiler, a failed build, a CPU without
AVX2/FMA, `GYRE_NATIVE_GEMM=0`) `library()` returns None, `reason()` says why (logged once), and
callers keep torch's kernels.
"""

from __future__ import annotations

import ctypes
import hashlib
import logging
import os
import platform
import shutil
import subprocess
import tempfile
import time
from pathlib import Path

import torch
import torch.nn.functional as F

_SOURCE = Path(__file__).with_name("native") / "small_gemm.c"
_FLAGS = ("-O3", "-shared", "-fPIC", "-std=c11")
LANES = 8  # columns per packed panel (one AVX2 register of float32)
_log = logging.getLogger(__name__)
_state: dict[str, object] = {}


def _compiler() -> str | None:
    return shutil.which(os.environ.get("CC", "cc")) or shutil.which("gcc")


def _cache_dir(compiler: str) -> Path:
    version = subprocess.run([compiler, "--version"], capture_output=True, text=True, timeout=30).stdout
    key = hashlib.sha256(_SOURCE.read_bytes() + " ".join(_FLAGS).encode() + version.encode()).hexdigest()
    root = os.environ.get("GYRE_NATIVE_CACHE") or Path.home() / ".cache" / "gyre-ray" / "native"
    return Path(root) / key[:16]


def _build() -> Path:
    """The compiled library's path, building it if this machine has none yet."""
    compiler = _compiler()
    if compiler is None:
        raise RuntimeError("no C compiler (set CC, or install gcc)")
    target = _cache_dir(compiler) / "small_gemm.so"
    if target.exists():
        return target
    target.parent.mkdir(parents=True, exist_ok=True)
    fd, partial = tempfile.mkstemp(dir=target.parent, suffix=".so.partial")
    os.close(fd)
    try:
        done = subprocess.run(
            [compiler, *_FLAGS, str(_SOURCE), "-o", partial], capture_output=True, text=True, timeout=120
        )
        if done.returncode != 0:
            raise RuntimeError(f"{compiler} failed: {done.stderr.strip()[-500:]}")
        os.replace(partial, target)
    finally:
        if os.path.exists(partial):
            os.unlink(partial)
    return target


def _load() -> tuple[ctypes.CDLL | None, str]:
    if os.environ.get("GYRE_NATIVE_GEMM", "1") == "0":
        return None, "off: GYRE_NATIVE_GEMM=0"
    if platform.system() != "Linux" or platform.machine() not in ("x86_64", "AMD64"):
        return None, f"off: needs x86-64 Linux, this is {platform.system()} {platform.machine()}"
    try:
        lib = ctypes.CDLL(str(_build()))
    except (OSError, RuntimeError, subprocess.SubprocessError) as exc:
        return None, f"off: {exc}"
    if not lib.gyre_small_gemm_supported():
        return None, "off: this CPU lacks AVX2 or FMA"
    lib.gyre_small_gemm.restype = None
    lib.gyre_small_gemm.argtypes = [
        ctypes.c_int, ctypes.c_int, ctypes.c_int,
        ctypes.c_void_p, ctypes.c_ssize_t, ctypes.c_void_p, ctypes.c_void_p, ctypes.c_ssize_t,
    ]  # fmt: skip
    lib.gyre_fma_loop.restype = ctypes.c_float
    lib.gyre_fma_loop.argtypes = [ctypes.c_long]
    return lib, "on"


def library() -> ctypes.CDLL | None:
    """The loaded kernel library, or None where it cannot run (`reason()` says why)."""
    if "lib" not in _state:
        lib, why = _load()
        _state["lib"], _state["reason"] = lib, why
        if lib is None:
            _log.warning("gyre-ray native GEMM %s; inference keeps torch's kernels", why)
    return _state["lib"]  # type: ignore[return-value]


def reason() -> str:
    """'on', or 'off: ...' saying why the kernel is not used."""
    library()
    return str(_state["reason"])


def fma_peak_gflops(seconds: float = 0.5) -> float | None:
    """This core's measured float32 AVX2 FMA rate (GFLOP/s), the compute roofline; None without the kernel."""
    lib = library()
    if lib is None:
        return None
    iterations = 1_000_000
    while True:
        start = time.perf_counter()
        lib.gyre_fma_loop(iterations)
        elapsed = time.perf_counter() - start
        if elapsed >= seconds:
            return iterations * 12 * LANES * 2 / elapsed / 1e9
        iterations *= 2


def pack(weight: torch.Tensor) -> torch.Tensor:
    """`weight` (N x K, float32) in the kernel's layout: panel p holds columns 8p..8p+7 as [p][k][8]."""
    if weight.dtype != torch.float32 or weight.device.type != "cpu" or weight.dim() != 2:
        raise ValueError(f"pack needs a 2-D float32 CPU weight, got {tuple(weight.shape)} {weight.dtype}")
    n, k = weight.shape
    panels = -(-n // LANES)
    padded = F.pad(weight.detach(), (0, 0, 0, panels * LANES - n))
    return padded.reshape(panels, LANES, k).transpose(1, 2).contiguous()


def gemm(x: torch.Tensor, packed: torch.Tensor, n: int) -> torch.Tensor:
    """`x @ W.T` for `packed = pack(W)` (W has `n` rows); x is (..., K) float32 on the CPU."""
    lib = library()
    if lib is None:
        raise RuntimeError(f"gyre-ray native GEMM is {reason()}")
    k = x.size(-1)
    if packed.dim() != 3 or packed.size(1) != k or packed.size(0) * LANES < n:
        raise ValueError(f"packed weight {tuple(packed.shape)} does not fit input K={k}, N={n}")
    if x.dtype != torch.float32 or x.device.type != "cpu":
        raise ValueError(f"native GEMM needs float32 CPU input, got {x.dtype} on {x.device}")
    rows = x.reshape(-1, k)
    if rows.stride(-1) != 1 or (rows.size(0) > 1 and rows.stride(0) < k):
        rows = rows.contiguous()
    count = rows.size(0)
    out = torch.empty(count, n, dtype=torch.float32)
    if count:
        row_stride = rows.stride(0) if count > 1 else k
        lib.gyre_small_gemm(count, n, k, rows.data_ptr(), row_stride, packed.data_ptr(), out.data_ptr(), n)
    return out.reshape(*x.shape[:-1], n)
