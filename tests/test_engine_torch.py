"""The torch rollout engine: greedy and seeded sampling, continuous batching, abort, prefix cache,
chunked prefill, stop tokens, batch limits and input validation, on a small random Qwen3 model."""

from __future__ import annotations

import asyncio
import importlib.util
import math
from asyncio import run

import pytest
import torch

from gyre_ray.engines import torch_engine
from gyre_ray.engines.base import (
    ABORT_TOKEN_ID,
    EngineInputError,
    GenerateRequest,
    SamplingParams,
)
from gyre_ray.engines.config import EngineSection
from gyre_ray.engines.factory import make_engine
from gyre_ray.engines.testing import GREEDY, token_prompt
from gyre_ray.engines.torch_engine import TorchEngine
from gyre_ray.model.qwen3 import Qwen3ForCausalLM


def test_greedy_output_is_the_argmax_continuation(new_engine, model: Qwen3ForCausalLM) -> None:
    engine = new_engine(model)
    result = run(engine.generate(GenerateRequest("r", token_prompt(9), GREEDY)))
    ids = torch.tensor([token_prompt(9)])
    with torch.no_grad():
        for _ in range(GREEDY.max_new_tokens):
            ids = torch.cat([ids, model(ids)[:, -1].argmax(-1, keepdim=True)], 1)
    assert result.output_ids == ids[0, 9:].tolist()
    assert result.finish_reason == "length"
    assert len(set(result.output_ids)) > 3  # a real continuation, not one repeated token
    assert result.output_versions == [0] * GREEDY.max_new_tokens


# padding ratio 0: rows of unequal length never share a batch; 1e9: everything shares one padded batch
@pytest.mark.parametrize("max_padding_ratio", [0.0, 1.0, 1e9])
def test_requests_joining_a_running_batch_get_the_tokens_they_get_alone(
    new_engine, model: Qwen3ForCausalLM, max_padding_ratio: float
) -> None:
    lengths = [5, 23, 40, 7, 61, 12]
    requests = [
        GenerateRequest(
            f"r{i}", token_prompt(n, start=i), SamplingParams(temperature=0.0, max_new_tokens=10 + 3 * i)
        )
        for i, n in enumerate(lengths)
    ]
    alone_engine = new_engine(model)
    alone = [run(alone_engine.generate(r)).output_ids for r in requests]

    engine = new_engine(model, max_batch_size=4, max_padding_ratio=max_padding_ratio)

    async def staggered():
        outputs: dict[str, list[int]] = {}
        tasks = []
        for r in requests:  # each joins once the previous one has 3 tokens, i.e. mid-generation
            started = asyncio.Event()

            async def consume(r=r, started=started):
                tokens = []
                async for event in engine.stream(r):
                    tokens.append(event.token_id)
                    if len(tokens) == 3:
                        started.set()
                outputs[r.rid] = tokens

            tasks.append(asyncio.create_task(consume()))
            await started.wait()
        await asyncio.gather(*tasks)
        return [outputs[r.rid] for r in requests]

    together = run(staggered())
    stats = engine.stats()
    assert together == alone
    total = sum(len(t) for t in alone)
    # batching happened: fewer decode forwards than decoded tokens (unless no two rows may share)
    if max_padding_ratio > 0:
        assert stats["decode_steps"] < total - len(requests)
    assert stats["running"] == 0 and stats["finished"] == len(requests)


def test_seeded_sampling_does_not_depend_on_batch_companions(new_engine, model: Qwen3ForCausalLM) -> None:
    params = SamplingParams(temperature=1.0, top_p=0.9, max_new_tokens=16, seed=1234)
    engine = new_engine(model)
    alone = run(engine.generate(GenerateRequest("s", token_prompt(11), params)))

    async def crowded():
        others = [
            engine.generate(
                GenerateRequest(
                    f"o{i}", token_prompt(8 + i), SamplingParams(temperature=1.0, max_new_tokens=20)
                )
            )
            for i in range(3)
        ]
        return await asyncio.gather(engine.generate(GenerateRequest("s", token_prompt(11), params)), *others)

    together = run(crowded())[0]
    unseeded = run(
        engine.generate(
            GenerateRequest("u", token_prompt(11), SamplingParams(temperature=1.0, max_new_tokens=16))
        )
    )
    assert together.output_ids == alone.output_ids
    assert together.output_logprobs == pytest.approx(alone.output_logprobs, abs=1e-5)
    assert unseeded.output_ids != alone.output_ids  # the seed, not the prompt, fixed the draw


def test_a_seeded_continuation_draws_the_tokens_the_unbroken_request_would_have(
    new_engine, model: Qwen3ForCausalLM
) -> None:
    """A call whose cell died after k sampled tokens goes on elsewhere from prompt + those k tokens
    with `draws_done=k` (what the proxy sends): the rest equals the unbroken request's."""
    params = SamplingParams(temperature=1.0, top_p=0.95, max_new_tokens=16, seed=77)
    engine = new_engine(model)
    whole = run(engine.generate(GenerateRequest("w", token_prompt(10), params)))
    k = 6
    head = whole.output_ids[:k]

    def rest(draws_done: int) -> list[int]:
        sampling = SamplingParams(
            temperature=1.0, top_p=0.95, max_new_tokens=16 - k, seed=77, draws_done=draws_done
        )
        return run(
            engine.generate(GenerateRequest(f"c{draws_done}", [*token_prompt(10), *head], sampling))
        ).output_ids

    assert rest(k) == whole.output_ids[k:]
    assert rest(0) != whole.output_ids[k:]  # restarting the draws would change the continuation
    with pytest.raises(EngineInputError, match="draws_done"):
        SamplingParams(draws_done=-1).validate()


def test_abort_returns_partial_output_and_ends_the_stream(new_engine, model: Qwen3ForCausalLM) -> None:
    engine = new_engine(model, max_batch_size=2)
    long = SamplingParams(temperature=0.0, max_new_tokens=400)

    async def scenario():
        events = []

        async def consume():
            async for event in engine.stream(GenerateRequest("a", token_prompt(6), long)):
                events.append(event)

        task = asyncio.create_task(consume())
        while len(events) < 3:
            await asyncio.sleep(0.001)
        partial = await engine.abort("a")
        await task
        return events, partial, await engine.abort("a"), await engine.abort("never-seen")

    events, partial, again, unknown = run(scenario())
    reference = run(engine.generate(GenerateRequest("b", token_prompt(6), long)))
    assert partial.finish_reason == "abort"
    assert 3 <= len(partial.output_ids) < 400
    assert partial.output_ids == reference.output_ids[: len(partial.output_ids)]
    assert events[-1].finish_reason == "abort" and events[-1].token_id == ABORT_TOKEN_ID
    assert [e.token_id for e in events[:-1]] == partial.output_ids
    assert again is None and unknown is None
    assert engine.stats()["aborted"] == 1


def test_second_turn_reuses_the_first_turns_prompt_and_output(new_engine, model: Qwen3ForCausalLM) -> None:
    engine = new_engine(model, prefix_cache_tokens=10_000)
    turn1 = token_prompt(40)
    first = run(engine.generate(GenerateRequest("t1", turn1, GREEDY)))
    before = engine.stats()
    new_message = token_prompt(9, start=200)
    turn2 = turn1 + first.output_ids + new_message
    second = run(engine.generate(GenerateRequest("t2", turn2, GREEDY)))
    after = engine.stats()
    # every token whose KV exists is reused: the prompt and all outputs but the last one sampled
    reused = len(turn1) + len(first.output_ids) - 1
    assert second.cached_tokens == reused
    assert after["prefix_cached_tokens"] - before["prefix_cached_tokens"] == reused
    assert after["prefill_computed_tokens"] - before["prefill_computed_tokens"] == len(new_message) + 1
    uncached = new_engine(model)
    assert run(uncached.generate(GenerateRequest("t2", turn2, GREEDY))).output_ids == second.output_ids


def test_long_prompts_prefill_in_chunks_with_the_same_result(new_engine, model: Qwen3ForCausalLM) -> None:
    whole = new_engine(model)
    chunked = new_engine(model, prefill_chunk_tokens=16)
    request = GenerateRequest("p", token_prompt(150), GREEDY)
    assert run(chunked.generate(request)).output_ids == run(whole.generate(request)).output_ids
    assert chunked.stats()["prefill_computed_tokens"] == 150


@pytest.mark.parametrize(
    ("input_ids", "sampling", "message"),
    [
        ([5, 512, 7], GREEDY, r"input_ids\[1\] = 512 is outside the vocabulary.*\[0, 512\)"),
        ([5, -1], GREEDY, r"input_ids\[1\] = -1 is outside the vocabulary"),
        ([5, 2.5], GREEDY, r"input_ids\[1\] = 2.5 is not an integer"),
        ([], GREEDY, "prompt is empty"),
        (
            token_prompt(1000),
            SamplingParams(max_new_tokens=100),
            r"1000 tokens\) \+ max_new_tokens \(100\).*1024",
        ),
        ([5, 6], SamplingParams(temperature=math.nan), "temperature must be a finite number"),
        ([5, 6], SamplingParams(top_p=0.0), r"top_p must be in \(0, 1\]"),
        ([5, 6], SamplingParams(max_new_tokens=0), "max_new_tokens must be an integer >= 1"),
        ([5, 6], SamplingParams(stop_token_ids=[9999]), r"stop_token_ids\[0\] = 9999"),
        ([5, 6], SamplingParams(seed=2**64), r"seed must be in \[-2\*\*63, 2\*\*64 - 1\]"),
    ],
)
def test_bad_input_is_refused_naming_the_limit_while_others_keep_running(
    new_engine, model: Qwen3ForCausalLM, input_ids: list, sampling: SamplingParams, message: str
) -> None:
    engine = new_engine(model)

    async def scenario():
        good = asyncio.create_task(engine.generate(GenerateRequest("good", token_prompt(8), GREEDY)))
        await asyncio.sleep(0)
        with pytest.raises(EngineInputError, match=message):
            await engine.generate(GenerateRequest("bad", input_ids, sampling))
        return await good

    good = run(scenario())
    after = run(engine.generate(GenerateRequest("after", token_prompt(8), GREEDY)))
    assert good.finish_reason == after.finish_reason == "length"
    assert good.output_ids == after.output_ids


def test_duplicate_request_id_is_refused(new_engine, model: Qwen3ForCausalLM) -> None:
    engine = new_engine(model)

    async def scenario():
        first = asyncio.create_task(engine.generate(GenerateRequest("dup", token_prompt(5), GREEDY)))
        await asyncio.sleep(0)
        with pytest.raises(EngineInputError, match="already running"):
            await engine.generate(GenerateRequest("dup", token_prompt(5), GREEDY))
        return await first

    assert run(scenario()).finish_reason == "length"


def test_stop_tokens_end_generation_and_are_returned(new_engine, model: Qwen3ForCausalLM) -> None:
    engine = new_engine(model)
    free = run(engine.generate(GenerateRequest("f", token_prompt(9), GREEDY)))
    stop_at = free.output_ids[4]
    stopped = run(
        engine.generate(
            GenerateRequest(
                "s",
                token_prompt(9),
                SamplingParams(temperature=0.0, max_new_tokens=12, stop_token_ids=[stop_at]),
            )
        )
    )
    cut = free.output_ids.index(stop_at) + 1
    assert stopped.output_ids == free.output_ids[:cut]
    assert stopped.finish_reason == "stop"


def test_a_stream_dropped_by_its_consumer_is_aborted(new_engine, model: Qwen3ForCausalLM) -> None:
    engine = new_engine(model)

    async def scenario():
        stream = engine.stream(
            GenerateRequest("d", token_prompt(5), SamplingParams(temperature=0.0, max_new_tokens=500))
        )
        async for _ in stream:
            break
        await stream.aclose()
        for _ in range(200):
            if engine.stats()["aborted"]:
                break
            await asyncio.sleep(0.005)

    run(scenario())
    stats = engine.stats()
    assert stats["aborted"] == 1 and stats["running"] == 0
    assert stats["decode_tokens"] < 500


def test_factory_builds_torch_and_explains_missing_backends(model: Qwen3ForCausalLM) -> None:
    engine = make_engine(EngineSection(max_batch_size=3, prefix_cache_tokens=0), model, model.args, version=7)
    assert isinstance(engine, TorchEngine) and engine.stats()["version"] == 7
    assert engine.stats()["max_batch_size"] == 3
    engine.shutdown()
    if importlib.util.find_spec("sglang") is None:  # on a GPU machine with sglang it would start a server
        with pytest.raises(NotImplementedError, match="needs the sglang package"):
            make_engine(EngineSection(backend="sglang"), model, model.args)


def test_max_batch_size_bounds_the_running_requests(new_engine, model: Qwen3ForCausalLM) -> None:
    engine = new_engine(model, max_batch_size=2)
    seen = []

    async def one(i: int):
        async for _ in engine.stream(
            GenerateRequest(f"b{i}", token_prompt(6 + i), SamplingParams(temperature=0.0, max_new_tokens=30))
        ):
            stats = engine.stats()
            seen.append((stats["running"], stats["waiting"]))

    async def scenario():
        await asyncio.gather(*(one(i) for i in range(5)))

    run(scenario())
    assert max(r for r, _ in seen) == 2
    assert max(w for _, w in seen) >= 1


def test_an_idle_engine_prefills_a_burst_of_requests_together(new_engine, monkeypatch) -> None:
    """Requests that arrive a little apart (within the burst window) are prefilled in one forward and
    decoded as one batch: one decode step per token after the first, not one more for an early row."""
    monkeypatch.setattr(torch_engine, "BURST_WINDOW_S", 0.5)
    engine = new_engine(stop_token_ids=[])
    params = SamplingParams(temperature=0.0, max_new_tokens=5)

    async def burst() -> list:
        tasks = []
        for i in range(4):
            tasks.append(
                asyncio.create_task(engine.generate(GenerateRequest(f"b{i}", token_prompt(6 + i), params)))
            )
            await asyncio.sleep(0.05)  # a slow submitter: the engine is awake before the next arrives
        return await asyncio.gather(*tasks)

    results = run(burst())
    assert [len(r.output_ids) for r in results] == [5] * 4
    assert engine.stats()["decode_steps"] == 4  # 5 tokens: the prefill's, then 4 steps of all rows
