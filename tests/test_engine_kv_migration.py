"""KV migration between torch engines: an exported request continues on another engine with exactly
the tokens of an uninterrupted run and without recomputing its prefix; partial or missing KV is
recomputed only where missing; states that do not fit are refused."""

from __future__ import annotations

from asyncio import run

import pytest

from gyre_ray.engines.base import (
    ABORT_TOKEN_ID,
    EngineInputError,
    GenerateRequest,
    KVState,
    SamplingParams,
    UnknownRequestError,
)
from gyre_ray.engines.testing import GREEDY, generate_alone, small_model, stream_until, token_prompt
from gyre_ray.model.qwen3 import Qwen3ForCausalLM


@pytest.mark.parametrize("sampling", [GREEDY, SamplingParams(temperature=1.0, max_new_tokens=12, seed=99)])
def test_exported_request_continues_on_another_engine_without_recomputing(
    new_engine, model: Qwen3ForCausalLM, sampling: SamplingParams
) -> None:
    sampling = SamplingParams(**{**sampling.__dict__, "max_new_tokens": 120})
    request = GenerateRequest("m", token_prompt(17), sampling)
    ref_engine = new_engine(model)
    reference = run(ref_engine.generate(request))

    source, target = new_engine(model), new_engine(small_model())  # same weights, separate objects

    async def migrate():
        await stream_until(source, request, 5)
        state = await source.export_kv("m")
        resumed = [e async for e in target.import_kv(state)]
        return state, resumed

    state, resumed = run(migrate())
    assert 5 <= len(state.output_ids) < 120
    assert state.kv["k.0"].shape[2] == len(state.input_ids) + len(state.output_ids) - 1
    assert state.kv["k.0"].device.type == "cpu"
    tokens = state.output_ids + [e.token_id for e in resumed]
    assert tokens == reference.output_ids
    logprobs = state.output_logprobs + [e.logprob for e in resumed]
    assert logprobs == pytest.approx(reference.output_logprobs, abs=1e-5)
    assert resumed[-1].finish_reason == "length"
    moved = target.stats()
    assert moved["prefill_computed_tokens"] == 0  # not one prefix token recomputed
    assert moved["imported_tokens"] == state.kv["k.0"].shape[2]
    assert moved["decode_tokens"] == 120 - len(state.output_ids)
    assert source.stats()["exported"] == 1
    with pytest.raises(UnknownRequestError, match="not running"):
        run(source.export_kv("m"))


@pytest.mark.parametrize("kept", [0, 10])
def test_import_with_partial_kv_prefills_only_the_missing_tokens(
    new_engine, model: Qwen3ForCausalLM, kept: int
) -> None:
    request = GenerateRequest("p", token_prompt(21), SamplingParams(temperature=0.0, max_new_tokens=120))
    reference = generate_alone(model, request)
    source, target = new_engine(model), new_engine(model)

    async def migrate():
        await stream_until(source, request, 4)
        state = await source.export_kv("p")
        state.kv = {name: t[:, :, :kept] for name, t in state.kv.items()} if kept else {}
        return state, [e async for e in target.import_kv(state)]

    state, resumed = run(migrate())
    assert state.output_ids + [e.token_id for e in resumed] == reference.output_ids
    context = len(state.input_ids) + len(state.output_ids) - 1
    assert target.stats()["prefill_computed_tokens"] == context - kept
    assert target.stats()["imported_tokens"] == kept


def test_import_refuses_states_that_do_not_fit(new_engine, model: Qwen3ForCausalLM) -> None:
    request = GenerateRequest("q", token_prompt(12), SamplingParams(temperature=0.0, max_new_tokens=200))
    source, target = new_engine(model), new_engine(model)

    async def scenario():
        await stream_until(source, request, 3)
        state = await source.export_kv("q")
        wrong_heads = dict(state.kv, **{"k.0": state.kv["k.0"][:, :1]})
        with pytest.raises(EngineInputError, match="kv_heads"):
            await anext(target.import_kv(KVState(**{**state.__dict__, "kv": wrong_heads})))
        done = KVState(**{**state.__dict__, "sampling": SamplingParams(max_new_tokens=len(state.output_ids))})
        with pytest.raises(EngineInputError, match="already finished"):
            await anext(target.import_kv(done))
        bad_ids = KVState(**{**state.__dict__, "output_ids": state.output_ids[:-1] + [10_000]})
        with pytest.raises(EngineInputError, match="outside the vocabulary"):
            await anext(target.import_kv(bad_ids))
        return [e.token_id async for e in target.import_kv(state)]

    resumed = run(scenario())
    assert 0 < len(resumed) <= 200 - 3 and resumed[-1] != ABORT_TOKEN_ID
    assert target.stats()["failed"] == 0
