"""Packed (fused; MKL- or oneDNN-packed) inference weights give the plain model's logits and follow weight changes."""

from __future__ import annotations

import contextlib
import copy
import os

import pytest
import torch

from gyre_ray.engines.testing import small_args
from gyre_ray.model import native_gemm, packed_linear
from gyre_ray.model.kv_cache import KVCache
from gyre_ray.model.packed_linear import (
    PackedLinear,
    free_packed_copies,
    pack_inference_weights,
    packing_supported,
    unpack_inference_weights,
)
from gyre_ray.model.qwen3 import Qwen3ForCausalLM, init_weights

pytestmark = pytest.mark.skipif(not packing_supported(torch.zeros(1)), reason="torch built without oneDNN")


@contextlib.contextmanager
def single_thread():
    """torch on one intra-op thread (as in a Ray actor): where the native packing serves calls."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        yield
    finally:
        torch.set_num_threads(threads)


def model_pair(seed: int = 0, **overrides) -> tuple[Qwen3ForCausalLM, Qwen3ForCausalLM]:
    args = small_args()
    for key, value in overrides.items():
        setattr(args, key, value)
    plain = init_weights(Qwen3ForCausalLM(args), seed=seed).eval()
    fast = copy.deepcopy(plain)
    assert pack_inference_weights(fast, rows_hint=4)
    return plain, fast


def prefill_then_decode(model: Qwen3ForCausalLM, ids: torch.Tensor, steps: int) -> torch.Tensor:
    """Logits of a prefill and `steps` greedy decode steps, concatenated along time."""
    cache = KVCache()
    with torch.inference_mode():
        logits = [model(ids, kv_cache=cache)]
        for _ in range(steps):
            logits.append(model(logits[-1][:, -1:].argmax(-1), kv_cache=cache))
    return torch.cat(logits, 1)


@pytest.mark.parametrize("tied", [True, False])
def test_packed_logits_equal_plain_in_prefill_and_decode(tied: bool) -> None:
    plain, fast = model_pair(tie_word_embeddings=tied)
    ids = torch.randint(0, 512, (3, 9), generator=torch.Generator().manual_seed(1))
    with single_thread():
        expected, got = prefill_then_decode(plain, ids, 5), prefill_then_decode(fast, ids, 5)
    assert got.shape == expected.shape == (3, 14, 512)
    torch.testing.assert_close(got, expected, atol=1e-5, rtol=1e-5)
    assert fast.model.layers[0].self_attn._packed["qkv"]._packed is not None  # the packed path ran


def test_packed_copies_follow_in_place_updates_replacements_and_free() -> None:
    plain, fast = model_pair()
    ids = torch.randint(0, 512, (2, 7), generator=torch.Generator().manual_seed(2))
    prefill_then_decode(fast, ids, 1)  # pack
    new_state = init_weights(Qwen3ForCausalLM(small_args()), seed=7).state_dict()
    plain.load_state_dict(new_state)
    fast.load_state_dict(new_state)  # in place: the version counters move
    torch.testing.assert_close(prefill_then_decode(fast, ids, 2), prefill_then_decode(plain, ids, 2))
    with torch.no_grad():  # an optimizer-like in-place step on one projection
        for model in (plain, fast):
            model.model.layers[1].mlp.up_proj.weight.mul_(1.5)
    torch.testing.assert_close(prefill_then_decode(fast, ids, 2), prefill_then_decode(plain, ids, 2))
    replacement = torch.randn_like(plain.model.layers[0].self_attn.k_proj.weight) * 0.02
    for model in (plain, fast):  # a new parameter object
        model.model.layers[0].self_attn.k_proj.weight = torch.nn.Parameter(replacement.clone())
    torch.testing.assert_close(prefill_then_decode(fast, ids, 2), prefill_then_decode(plain, ids, 2))
    free_packed_copies(fast)
    assert fast._packed["lm_head"]._packed is None
    torch.testing.assert_close(prefill_then_decode(fast, ids, 1), prefill_then_decode(plain, ids, 1))
    copied = copy.deepcopy(fast)  # copies carry no oneDNN tensor and pack again on use
    torch.testing.assert_close(prefill_then_decode(copied, ids, 1), prefill_then_decode(plain, ids, 1))
    unpack_inference_weights(fast)
    assert fast._packed is None
    torch.testing.assert_close(prefill_then_decode(fast, ids, 1), prefill_then_decode(plain, ids, 1))


def test_training_forward_bypasses_packed_copies_and_gradients_match() -> None:
    plain, fast = model_pair()
    ids = torch.randint(0, 512, (2, 6), generator=torch.Generator().manual_seed(3))
    for model in (plain, fast):
        model(ids).logsumexp(-1).sum().backward()
    assert fast._packed["lm_head"]._packed is None  # never packed: gradients went through F.linear
    for (name, a), (_, b) in zip(plain.named_parameters(), fast.named_parameters(), strict=True):
        assert torch.equal(a.grad, b.grad), name


def test_unsupported_dtype_keeps_plain_linear() -> None:
    model = init_weights(Qwen3ForCausalLM(small_args()), seed=0).double().eval()
    assert not pack_inference_weights(model)
    assert getattr(model, "_packed", None) is None
    with torch.inference_mode():
        assert model(torch.tensor([[1, 2, 3]])).dtype == torch.float64


def fused_group(seed: int = 0) -> tuple[list[torch.nn.Linear], torch.Tensor]:
    """Three projections of one input (like q/k/v) and their stacked weight."""
    torch.manual_seed(seed)
    layers = [torch.nn.Linear(48, n, bias=False) for n in (32, 16, 16)]
    return layers, torch.cat([layer.weight.detach() for layer in layers])


@pytest.mark.parametrize("kind", ["native", "mkl", "onednn"])
def test_packed_products_equal_f_linear_at_every_row_count(kind: str, monkeypatch) -> None:
    """Rows below, at and above the packing's hint (the MKL packing is made for 4 rows here)."""
    if kind == "native" and not packed_linear._native_available():
        message = f"native GEMM {native_gemm.reason()}"
        pytest.fail(message) if os.environ.get("CI") else pytest.skip(message)
    if kind == "mkl" and not packed_linear._mkl_supported():
        pytest.skip("torch built without MKL")
    # whichever kind is fastest on this CPU, each is tested: the race puts `kind` first
    monkeypatch.setattr(
        PackedLinear, "_race", lambda self, kinds, merged: sorted(kinds, key=lambda k: k != kind)
    )
    layers, merged = fused_group()
    fused = PackedLinear(layers, rows_hint=4)
    with torch.inference_mode(), single_thread():
        for rows in (1, 2, 3, 4, 5, 9, 40):
            x = torch.randn(rows, 1, 48)
            torch.testing.assert_close(fused(x), torch.nn.functional.linear(x, merged), atol=1e-5, rtol=1e-5)
            parts = fused.split(x)
            assert [p.size(-1) for p in parts] == [32, 16, 16]
            torch.testing.assert_close(torch.cat(parts, -1), fused(x))
    assert fused.kind == kind


class WrongMKL:
    """Test fake of torch.ops.mkl whose packed products are wrong (an MKL whose packing depended on rows)."""

    def _mkl_reorder_linear_weight(self, weight: torch.Tensor, rows: int) -> torch.Tensor:
        return weight.clone()

    def _mkl_linear(self, x, packed, shape, bias, rows) -> torch.Tensor:
        return torch.nn.functional.linear(x, packed) + 1.0


def test_a_packing_that_disagrees_with_f_linear_falls_back_to_onednn(monkeypatch) -> None:
    monkeypatch.setattr(packed_linear, "_native_available", lambda: False)
    monkeypatch.setattr(PackedLinear, "_race", lambda self, kinds, merged: kinds)  # MKL first
    monkeypatch.setattr(packed_linear, "_MKL", WrongMKL())
    monkeypatch.setattr(packed_linear, "_mkl_supported", lambda: True)
    layers, merged = fused_group(1)
    fused = PackedLinear(layers, rows_hint=4)
    x = torch.randn(4, 48)
    with torch.inference_mode():
        torch.testing.assert_close(fused(x), torch.nn.functional.linear(x, merged), atol=1e-5, rtol=1e-5)
    assert fused.kind == "onednn" and fused._packed is not None  # oneDNN's packing serves it
