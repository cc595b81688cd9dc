"""gyre-ray's native CPU GEMM: exact enough on every shape, built once, and a clean fallback where it cannot run."""

from __future__ import annotations

import os

import pytest
import torch

from gyre_ray.model import native_gemm, packed_linear
from gyre_ray.model.packed_linear import PackedLinear


@pytest.fixture
def native() -> None:
    """The kernel must load here; under CI (gcc on the machine) a skip would hide a broken build."""
    if native_gemm.library() is None:
        message = f"native GEMM {native_gemm.reason()}"
        pytest.fail(message) if os.environ.get("CI") else pytest.skip(message)


@pytest.fixture
def fresh_state(monkeypatch, tmp_path):
    """A private cache and no loaded library, so `library()` builds (or fails) again."""
    monkeypatch.setattr(native_gemm, "_state", {})
    monkeypatch.setenv("GYRE_NATIVE_CACHE", str(tmp_path / "cache"))
    return tmp_path / "cache"


@pytest.mark.parametrize(
    ("rows", "n", "k"),
    [(1, 5, 3), (2, 8, 16), (3, 17, 9), (4, 24, 64), (5, 25, 31), (7, 1280, 96), (16, 8193, 64), (41, 40, 7)],
)
def test_products_equal_torch_on_odd_shapes(native, rows: int, n: int, k: int) -> None:
    """Row blocks of 1-4, one to three panels, a zero-padded last panel, K not a multiple of 8."""
    gen = torch.Generator().manual_seed(rows * 1000 + n)
    x, w = torch.randn(rows, k, generator=gen), torch.randn(n, k, generator=gen)
    got = native_gemm.gemm(x, native_gemm.pack(w), n)
    assert got.shape == (rows, n)
    torch.testing.assert_close(got, x @ w.T, atol=1e-4, rtol=1e-5)


def test_batched_strided_and_empty_inputs(native) -> None:
    w = torch.randn(20, 32)
    packed = native_gemm.pack(w)
    batched = torch.randn(4, 10, 32)[:, ::2]  # (4, 5, 32), not contiguous
    torch.testing.assert_close(native_gemm.gemm(batched, packed, 20), batched @ w.T, atol=1e-5, rtol=1e-5)
    row_view = torch.randn(6, 40)[:, :32]  # row stride 40: read in place
    torch.testing.assert_close(native_gemm.gemm(row_view, packed, 20), row_view @ w.T, atol=1e-5, rtol=1e-5)
    assert native_gemm.gemm(torch.randn(0, 32), packed, 20).shape == (0, 20)


def test_the_fma_peak_is_measured(native) -> None:
    peak = native_gemm.fma_peak_gflops(seconds=0.02)
    assert peak is not None and 0.5 < peak < 500  # GFLOP/s of one core, whatever the CPU


def test_bad_inputs_are_refused_with_the_shapes(native) -> None:
    packed = native_gemm.pack(torch.randn(16, 8))
    with pytest.raises(ValueError, match="does not fit input K=9"):
        native_gemm.gemm(torch.randn(2, 9), packed, 16)
    with pytest.raises(ValueError, match="float32"):
        native_gemm.gemm(torch.randn(2, 8, dtype=torch.float64), packed, 16)
    with pytest.raises(ValueError, match="2-D float32"):
        native_gemm.pack(torch.randn(4, 4, 4))


def test_the_library_is_built_once_per_cache(native, fresh_state) -> None:
    assert native_gemm.library() is not None and native_gemm.reason() == "on"
    built = list(fresh_state.glob("*/small_gemm.so"))
    assert len(built) == 1 and not list(fresh_state.glob("*/*.partial"))
    stamp = built[0].stat().st_mtime_ns
    native_gemm._state.clear()
    assert native_gemm.library() is not None
    assert built[0].stat().st_mtime_ns == stamp  # loaded, not rebuilt


def test_no_compiler_or_switched_off_means_torch_kernels_and_a_reason(fresh_state, monkeypatch) -> None:
    monkeypatch.setenv("CC", "/nonexistent/cc")
    monkeypatch.setattr(native_gemm.shutil, "which", lambda name: None)
    assert native_gemm.library() is None
    assert native_gemm.reason() == "off: no C compiler (set CC, or install gcc)"
    with pytest.raises(RuntimeError, match="no C compiler"):
        native_gemm.gemm(torch.randn(1, 4), torch.zeros(1, 4, 8), 8)
    native_gemm._state.clear()
    monkeypatch.setenv("GYRE_NATIVE_GEMM", "0")
    assert native_gemm.library() is None and native_gemm.reason() == "off: GYRE_NATIVE_GEMM=0"
    layer = torch.nn.Linear(16, 8, bias=False)
    fused = PackedLinear([layer], rows_hint=4)
    x = torch.randn(3, 16)
    with torch.inference_mode():
        torch.testing.assert_close(fused(x), layer(x), atol=1e-5, rtol=1e-5)
    assert fused.kind in ("mkl", "onednn")


def test_a_native_packing_leaves_several_threads_to_mkl_and_a_wrong_kernel_gives_way(
    native, monkeypatch
) -> None:
    monkeypatch.setattr(PackedLinear, "_race", lambda self, kinds, merged: kinds)  # native first
    layer = torch.nn.Linear(16, 24, bias=False)
    fused = PackedLinear([layer], rows_hint=4)
    x = torch.randn(3, 16)
    threads = torch.get_num_threads()
    calls = []
    real = native_gemm.gemm
    monkeypatch.setattr(native_gemm, "gemm", lambda *a: calls.append(1) or real(*a))
    try:
        with torch.inference_mode():
            torch.set_num_threads(1)
            torch.testing.assert_close(fused(x), layer(x), atol=1e-5, rtol=1e-5)
            assert fused.kind == "native"
            used = len(calls)
            assert used > 0  # one thread: the native kernel served the call (else the check below is empty)
            torch.set_num_threads(2)
            torch.testing.assert_close(fused(x), layer(x), atol=1e-5, rtol=1e-5)
            assert len(calls) == used  # several threads: F.linear, not the one-thread kernel
    finally:
        torch.set_num_threads(threads)
    monkeypatch.setattr(native_gemm, "gemm", lambda *a: real(*a) + 1.0)  # a miscompiled kernel
    wrong = PackedLinear([layer], rows_hint=4)
    with torch.inference_mode():
        torch.testing.assert_close(wrong(x), layer(x), atol=1e-5, rtol=1e-5)
    assert wrong.kind == ("mkl" if packed_linear._mkl_supported() else "onednn")


def test_the_kinds_are_raced_once_per_shape_and_the_fastest_serves(native, monkeypatch) -> None:
    if not packed_linear._mkl_supported():
        pytest.skip("torch built without MKL")
    monkeypatch.setattr(packed_linear, "_RANKED", {})
    seconds = iter([3.0, 1.0, 2.0])  # native, mkl, onednn, in the order they are timed
    timed = []
    monkeypatch.setattr(packed_linear, "_seconds_per_call", lambda gemm, x: timed.append(1) or next(seconds))
    layer = torch.nn.Linear(16, 24, bias=False)
    first, second = PackedLinear([layer], rows_hint=4), PackedLinear([layer], rows_hint=4)
    x = torch.randn(3, 16)
    with torch.inference_mode():
        torch.testing.assert_close(first(x), layer(x), atol=1e-5, rtol=1e-5)
        torch.testing.assert_close(second(x), layer(x), atol=1e-5, rtol=1e-5)
    assert len(timed) == 3  # each kind timed once, for the first copy only
    assert first.kind == second.kind == "mkl"
    assert packed_linear._RANKED == {(24, 16, 4): ["mkl", "onednn", "native"]}
