"""Weights in the torch engine: updates at a safe point version later tokens and drop stale prefix KV;
release frees the weights, requests wait (running ones pause) until new weights arrive."""

from __future__ import annotations

import asyncio
from asyncio import run

import pytest
import torch

from gyre_ray.engines.base import (
    EngineInputError,
    GenerateRequest,
    SamplingParams,
)
from gyre_ray.engines.testing import GREEDY, generate_alone, small_model, token_prompt
from gyre_ray.model.qwen3 import Qwen3ForCausalLM


def test_weight_update_versions_tokens_and_drops_stale_prefix_kv(new_engine, model: Qwen3ForCausalLM) -> None:
    engine = new_engine(model, prefix_cache_tokens=10_000)
    run(engine.generate(GenerateRequest("a", token_prompt(30), GREEDY)))
    assert engine.stats()["prefix_cache_tokens"] > 0
    new_model = small_model(seed=5)
    run(engine.update_weights(new_model.state_dict(), version=3))
    assert engine.stats()["prefix_cache_tokens"] == 0
    updated = run(engine.generate(GenerateRequest("b", token_prompt(30), GREEDY)))
    fresh = new_engine(new_model)
    expected = run(fresh.generate(GenerateRequest("b", token_prompt(30), GREEDY)))
    assert updated.output_ids == expected.output_ids
    assert updated.cached_tokens == 0
    assert updated.output_versions == [3] * GREEDY.max_new_tokens
    other = new_engine(model)
    with pytest.raises(EngineInputError, match="missing"):
        run(other.update_weights({"lm_head.weight": torch.zeros(1)}, version=4))


def test_release_frees_weights_and_requests_wait_for_new_ones(new_engine, model: Qwen3ForCausalLM) -> None:
    weights = {k: v.clone() for k, v in model.state_dict().items()}
    reference = generate_alone(small_model(), GenerateRequest("r", token_prompt(10), GREEDY))
    engine = new_engine(model)

    async def scenario():
        await engine.release_memory()
        assert model.model.embed_tokens.weight.numel() == 0
        stats = engine.stats()
        assert stats["released"] and not stats["weights_loaded"]
        pending = asyncio.create_task(engine.generate(GenerateRequest("r", token_prompt(10), GREEDY)))
        await engine.resume_memory()
        await asyncio.sleep(0.05)
        assert not pending.done()  # re-allocated but not yet filled: no garbage tokens
        await engine.update_weights(weights, version=1)
        return await pending

    result = run(scenario())
    assert result.output_ids == reference.output_ids
    assert result.output_versions == [1] * GREEDY.max_new_tokens


def test_running_requests_pause_over_release_and_continue_with_the_new_version(
    new_engine,
    model: Qwen3ForCausalLM,
) -> None:
    request = GenerateRequest("long", token_prompt(10), SamplingParams(temperature=0.0, max_new_tokens=150))
    reference = generate_alone(small_model(), request)
    weights = {k: v.clone() for k, v in model.state_dict().items()}
    engine = new_engine(model, prefix_cache_tokens=10_000)

    async def scenario():
        events = []

        async def consume():
            async for event in engine.stream(request):
                events.append(event)

        task = asyncio.create_task(consume())
        while len(events) < 3:
            await asyncio.sleep(0.001)
        await engine.release_memory()
        paused_at = len(events)
        await asyncio.sleep(0.05)
        assert len(events) == paused_at and engine.stats()["running"] == 1
        await engine.resume_memory()
        await engine.update_weights(weights, version=1)
        await task
        return events, paused_at

    events, paused_at = run(scenario())
    stats = engine.stats()
    assert stats["prefix_cache_tokens"] == 0  # its KV predates version 1: not offered for reuse
    assert [e.token_id for e in events] == reference.output_ids
    versions = [e.version for e in events]
    assert versions == [0] * paused_at + [1] * (150 - paused_at)
