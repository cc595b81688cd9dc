"""Batched prefill: the requests waiting at a scheduling round are prefilled in one forward (one pass
over the weights), each over its own cache, with the tokens and log-probs each gets alone."""

from __future__ import annotations

import asyncio
from asyncio import run

from gyre_ray.engines.base import GenerateRequest, SamplingParams
from gyre_ray.engines.testing import token_prompt
from gyre_ray.model.packed_kv import PackedCaches
from gyre_ray.model.qwen3 import Qwen3ForCausalLM

TOL = 1e-5


def spy_prefills(model: Qwen3ForCausalLM, monkeypatch) -> list[list[int]]:
    """Record the segment lengths of every packed prefill forward."""
    calls: list[list[int]] = []
    real = model.hidden_states

    def hidden_states(input_ids, position_ids=None, attention_mask=None, kv_cache=None):
        if isinstance(kv_cache, PackedCaches):
            calls.append(list(kv_cache.lengths))
        return real(input_ids, position_ids, attention_mask, kv_cache)

    monkeypatch.setattr(model, "hidden_states", hidden_states)
    return calls


async def queued_then_run(engine, requests: list[GenerateRequest]) -> list:
    """Submit every request while the engine is paused, so one scheduling round finds them all waiting."""
    await engine.release_memory()  # nothing runs while released (weights kept: the engine is told so)
    tasks = [asyncio.ensure_future(engine.generate(r)) for r in requests]
    await asyncio.sleep(0.2)
    await engine.resume_memory()
    return await asyncio.gather(*tasks)


def test_waiting_requests_are_prefilled_in_one_forward_with_their_solo_results(
    new_engine, model: Qwen3ForCausalLM, monkeypatch
) -> None:
    lengths = [5, 23, 40, 7, 61, 12]
    params = SamplingParams(temperature=0.0, max_new_tokens=6)
    requests = [GenerateRequest(f"r{i}", token_prompt(n, start=i), params) for i, n in enumerate(lengths)]
    solo_engine = new_engine(model)
    solo = [run(solo_engine.generate(r)) for r in requests]
    engine = new_engine(model, max_batch_size=8, prefix_cache_tokens=0, free_weights_on_release=False)
    calls = spy_prefills(model, monkeypatch)

    together = run(queued_then_run(engine, requests))
    assert calls == [lengths]  # one forward over all six prompts
    for alone, joint in zip(solo, together, strict=True):
        assert joint.output_ids == alone.output_ids
        assert (
            max(abs(a - b) for a, b in zip(joint.output_logprobs, alone.output_logprobs, strict=True)) <= TOL
        )


def test_a_round_budget_splits_prompts_across_rounds_and_continues_after_a_past(
    new_engine, model: Qwen3ForCausalLM, monkeypatch
) -> None:
    params = SamplingParams(temperature=0.0, max_new_tokens=5)
    requests = [
        GenerateRequest(f"c{i}", token_prompt(n, start=3 * i), params) for i, n in enumerate([30, 50, 9])
    ]
    solo_engine = new_engine(model)
    solo = [run(solo_engine.generate(r)).output_ids for r in requests]
    engine = new_engine(model, prefill_chunk_tokens=32, prefix_cache_tokens=0, free_weights_on_release=False)
    calls = spy_prefills(model, monkeypatch)

    together = [r.output_ids for r in run(queued_then_run(engine, requests))]
    assert together == solo
    assert all(sum(c) <= 32 for c in calls)  # each round within its token budget
    assert calls[0] == [30, 2] and sum(map(sum, calls)) == 30 + 50 + 9  # 50 continues after its past
