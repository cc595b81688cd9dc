"""The SGLang engine's protocol code against a fake server speaking SGLang's HTTP API (CPU).

`tests/fake_sglang.py` answers SGLang's routes and JSON shapes from a torch engine over the tiny
model, so what the adapter produces can be compared with the torch engine on the same weights.
Real SGLang needs a GPU: `tests/test_engine_sglang_gpu.py` runs against it (marked `gpu`).
"""

from __future__ import annotations

import asyncio
import importlib.util
import time
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch
from fake_sglang import FakeSGLang, encode_tensors, key_from_command

from gyre_ray.cells.cell import Migrated, RolloutCell, TokenBatch
from gyre_ray.engines.base import ABORT_TOKEN_ID, EngineInputError, GenerateRequest, SamplingParams
from gyre_ray.engines.config import EngineSection, SGLangOptions
from gyre_ray.engines.factory import make_engine
from gyre_ray.engines.sglang import SGLangClient, SGLangEngine, SGLangServerError, SGLangUnavailableError
from gyre_ray.engines.sglang.protocol import ChunkReader, token_versions
from gyre_ray.engines.sglang.server import (
    SGLangServer,
    check_available,
    launch_command,
    new_api_key,
    write_key_config,
)
from gyre_ray.engines.sglang.weight_sync import WeightBroadcaster, buckets
from gyre_ray.engines.testing import GREEDY, generate_alone, small_engine, small_model, token_prompt
from gyre_ray.model.qwen3 import Qwen3ForCausalLM

LONG = SamplingParams(temperature=0.0, max_new_tokens=400)
# the fake server's pace: 400 tokens take 2 s, longer than the engine's 0.5 s between abort retries
TOKEN_DELAY_S = 0.005


@pytest.fixture
def fake(model: Qwen3ForCausalLM) -> Iterator[FakeSGLang]:
    backing = small_engine(small_model(), prefix_cache_tokens=0)  # its own copy of the weights
    server = FakeSGLang(backing, token_delay_s=TOKEN_DELAY_S)
    yield server
    server.close()
    backing.shutdown()


def sglang_engine(fake: FakeSGLang, **options) -> SGLangEngine:
    args = fake.args
    client = SGLangClient(
        fake.url,
        "cell-7",
        connect_timeout_s=2.0,
        request_timeout_s=options.pop("timeout", 60),
        api_key=fake.api_key,  # what the cell holds for the server it started
    )
    return SGLangEngine(
        client, vocab_size=args.vocab_size, max_context=args.max_position_embeddings, **options
    )


async def start_stream(stream, at_least: int) -> tuple[list, asyncio.Task]:
    """Consume `stream` in a background task; return once it has yielded `at_least` items."""
    items: list = []

    async def consume() -> None:
        async for item in stream:
            items.append(item)

    task = asyncio.create_task(consume())
    while len(items) < at_least and not task.done():
        await asyncio.sleep(0.01)
    return items, task


def test_generate_returns_the_torch_engines_tokens_and_logprobs(fake: FakeSGLang, model) -> None:
    engine = sglang_engine(fake)
    request = GenerateRequest("g1", token_prompt(9), GREEDY)
    got = asyncio.run(engine.generate(request))
    want = generate_alone(model, request)
    assert got.output_ids == want.output_ids and got.finish_reason == "length"
    assert torch.allclose(torch.tensor(got.output_logprobs), torch.tensor(want.output_logprobs), atol=1e-6)
    assert got.output_versions == [0] * 12
    route, body = fake.calls[-1]
    assert route == "/generate" and body["input_ids"] == token_prompt(9) and body["return_logprob"] is True
    assert body["rid"] == "g1" and body["stream"] is True
    params = body["sampling_params"]
    assert params["max_new_tokens"] == 12 and params["temperature"] == 0.0 and params["ignore_eos"] is True
    stats = engine.stats()
    assert (
        stats["requests"] == stats["finished"] == 1 and stats["decode_tokens"] == 12 and stats["running"] == 0
    )


@pytest.mark.parametrize("incremental", [False, True])
def test_stream_yields_each_token_once_in_either_streaming_mode(model, incremental: bool) -> None:
    backing = small_engine(small_model(), prefix_cache_tokens=0)
    server = FakeSGLang(backing, incremental=incremental)
    try:
        engine = sglang_engine(server)
        request = GenerateRequest(
            "s1", token_prompt(6, start=11), SamplingParams(temperature=0.0, max_new_tokens=20)
        )

        async def collect():
            return [event async for event in engine.stream(request)]

        events = asyncio.run(collect())
    finally:
        server.close()
        backing.shutdown()
    want = generate_alone(model, request)
    assert [e.token_id for e in events] == want.output_ids
    assert [e.finish_reason for e in events] == [None] * 19 + ["length"]


def test_stop_ids_of_engine_and_request_reach_the_server_and_end_the_request(fake: FakeSGLang, model) -> None:
    free = asyncio.run(sglang_engine(fake).generate(GenerateRequest("f", token_prompt(5), GREEDY)))
    stop = free.output_ids[4]
    engine = sglang_engine(fake, stop_token_ids=[511])
    sampling = SamplingParams(temperature=0.0, max_new_tokens=12, stop_token_ids=[stop])
    got = asyncio.run(engine.generate(GenerateRequest("st", token_prompt(5), sampling)))
    first = free.output_ids.index(stop)
    assert got.output_ids == free.output_ids[: first + 1] and got.finish_reason == "stop"
    params = fake.calls[-1][1]["sampling_params"]
    assert params["stop_token_ids"] == sorted({511, stop}) and params["ignore_eos"] is False


def test_abort_returns_the_partial_output_and_ends_the_stream(fake: FakeSGLang) -> None:
    engine = sglang_engine(fake)

    async def scenario():
        events, task = await start_stream(engine.stream(GenerateRequest("a1", token_prompt(8), LONG)), 3)
        partial = await engine.abort("a1")
        await asyncio.wait_for(task, 30)
        return partial, events, await engine.abort("a1"), await engine.abort("never")

    partial, events, again, unknown = asyncio.run(scenario())
    assert partial.finish_reason == "abort" and 3 <= len(partial.output_ids) < 400
    assert [e.token_id for e in events[:-1]] == partial.output_ids
    assert events[-1].token_id == ABORT_TOKEN_ID and events[-1].finish_reason == "abort"
    assert again is None and unknown is None
    assert ("/abort_request", {"rid": "a1"}) in fake.calls
    assert engine.stats()["aborted"] == 1


def test_a_consumer_that_leaves_early_aborts_its_request(fake: FakeSGLang) -> None:
    engine = sglang_engine(fake)

    async def scenario():
        async for _ in engine.stream(GenerateRequest("left", token_prompt(8), LONG)):
            break
        for _ in range(500):
            if engine.stats()["running"] == 0 and not fake.running:
                return
            await asyncio.sleep(0.01)

    asyncio.run(scenario())
    assert engine.stats()["aborted"] == 1 and not fake.running


def test_export_declares_no_kv_and_import_reprefills_to_the_same_tokens(fake: FakeSGLang, model) -> None:
    engine = sglang_engine(fake)
    assert SGLangEngine.kv_export is False and engine.stats()["kv_export"] is False
    sampling = SamplingParams(temperature=0.0, max_new_tokens=30)
    prompt = token_prompt(7, start=5)
    want = generate_alone(model, GenerateRequest("w", prompt, sampling))

    async def scenario():
        _, task = await start_stream(engine.stream(GenerateRequest("m1", prompt, sampling)), 4)
        state = await engine.export_kv("m1")
        await task
        rest = [event async for event in engine.import_kv(state)]
        return state, rest

    state, rest = asyncio.run(scenario())
    assert state.kv is None and state.input_ids == prompt and len(state.output_ids) >= 4
    body = fake.calls[-1][1]
    assert body["input_ids"] == prompt + state.output_ids  # re-prefill of prompt + output so far
    assert body["sampling_params"]["max_new_tokens"] == 30 - len(state.output_ids)
    assert state.output_ids + [e.token_id for e in rest] == want.output_ids
    stats = engine.stats()
    assert stats["exported"] == stats["imported"] == 1 and stats["reprefill_tokens"] == len(body["input_ids"])
    with pytest.raises(KeyError, match="not running in cell cell-7"):
        asyncio.run(engine.export_kv("gone"))


def test_a_state_exported_by_sglang_continues_on_the_torch_engine(
    fake: FakeSGLang, model, new_engine
) -> None:
    engine = sglang_engine(fake)
    sampling = SamplingParams(temperature=0.0, max_new_tokens=25)
    prompt = token_prompt(6, start=2)

    async def scenario():
        _, task = await start_stream(engine.stream(GenerateRequest("x1", prompt, sampling)), 3)
        state = await engine.export_kv("x1")
        await task
        torch_engine = new_engine(model)
        return state, [e.token_id async for e in torch_engine.import_kv(state)]

    state, rest = asyncio.run(scenario())
    want = generate_alone(model, GenerateRequest("w", prompt, sampling))
    assert state.output_ids + rest == want.output_ids


def test_release_and_resume_memory_call_the_server_around_training(fake: FakeSGLang, model) -> None:
    engine = sglang_engine(fake)

    async def scenario():
        await engine.release_memory()
        released = engine.stats()["released"]
        await engine.resume_memory()
        return released, await engine.generate(GenerateRequest("after", token_prompt(5), GREEDY))

    released, result = asyncio.run(scenario())
    assert released is True and engine.stats()["released"] is False
    assert fake.routes()[:2] == ["/release_memory_occupation", "/resume_memory_occupation"]
    assert fake.released_tags == [None]  # every tag: weights, KV cache, CUDA graphs
    assert (
        result.output_ids == generate_alone(model, GenerateRequest("w", token_prompt(5), GREEDY)).output_ids
    )


@pytest.mark.parametrize("weight_sync", ["disk", "tensor"])
def test_update_weights_reaches_the_server_and_tags_later_tokens(fake: FakeSGLang, weight_sync: str) -> None:
    engine = sglang_engine(fake, weight_sync=weight_sync, tensor_serializer=encode_tensors)
    new = small_model(seed=5)
    request = GenerateRequest("u1", token_prompt(8), GREEDY)
    asyncio.run(engine.update_weights(new.state_dict(), 3))
    got = asyncio.run(engine.generate(request))
    assert got.output_ids == generate_alone(new, request).output_ids
    assert got.output_versions == [3] * 12 and engine.stats()["weight_updates"] == 1
    route, body = next(c for c in fake.calls if c[0].startswith("/update_weights"))
    assert body["weight_version"] == "3"
    if weight_sync == "disk":
        assert route == "/update_weights_from_disk" and not Path(body["model_path"]).exists()  # cleaned up
    else:
        assert route == "/update_weights_from_tensor" and len(body["serialized_named_tensors"]) == 1


def test_a_refused_weight_update_raises_and_keeps_the_version(fake: FakeSGLang) -> None:
    engine = sglang_engine(fake)
    wrong = {"model.embed_tokens.weight": torch.zeros(3, 3)}
    with pytest.raises(SGLangServerError, match=r"cell cell-7: SGLang server .*update_weights_from_disk"):
        asyncio.run(engine.update_weights(wrong, 1))
    assert engine.version == 0 and engine.stats()["weight_updates"] == 0


def test_weights_broadcast_through_the_update_group_in_buckets(fake: FakeSGLang) -> None:
    engine = sglang_engine(fake)
    new = small_model(seed=9)
    from gyre_ray.ports import free_port

    async def scenario():
        sender = WeightBroadcaster([engine], "127.0.0.1", free_port(), group_name="g", backend="gloo")
        await sender.connect()
        return await sender.send(new.state_dict(), 4, bucket_bytes=64 << 10)

    sent = asyncio.run(asyncio.wait_for(scenario(), 120))
    state = new.state_dict()
    assert sent == len(list(buckets(state, 64 << 10))) > 1
    init = next(body for route, body in fake.calls if route == "/init_weights_update_group")
    assert init["rank_offset"] == 1 and init["world_size"] == 2 and init["backend"] == "gloo"
    updates = [body for route, body in fake.calls if route == "/update_weights_from_distributed"]
    assert sum(len(u["names"]) for u in updates) == len(state) and updates[0]["weight_version"] == "4"
    request = GenerateRequest("b1", token_prompt(8), GREEDY)
    got = asyncio.run(engine.generate(request))
    assert got.output_ids == generate_alone(new, request).output_ids and got.output_versions == [4] * 12


def test_flush_cache_is_refused_while_requests_run(fake: FakeSGLang) -> None:
    engine = sglang_engine(fake)

    async def scenario():
        idle = await engine.flush_cache()
        _, task = await start_stream(engine.stream(GenerateRequest("fl", token_prompt(8), LONG)), 1)
        busy = await engine.flush_cache()
        await engine.abort("fl")
        await task
        return idle, busy

    assert asyncio.run(scenario()) == (True, False)
    assert fake.flushes == 1


def test_bad_input_is_refused_locally_and_by_the_server(fake: FakeSGLang) -> None:
    engine = sglang_engine(fake)
    with pytest.raises(EngineInputError, match="outside the vocabulary"):
        asyncio.run(engine.generate(GenerateRequest("v", [1, 2, 9999], GREEDY)))
    assert not fake.calls  # never sent
    wide = SGLangEngine(  # believes in a larger vocabulary than the server's model has
        SGLangClient(fake.url, "cell-3", api_key=fake.api_key),
        vocab_size=10_000,
        max_context=fake.args.max_position_embeddings,
    )
    with pytest.raises(EngineInputError, match="cell cell-3: SGLang server .*refused the request"):
        asyncio.run(wide.generate(GenerateRequest("v2", [1, 2, 9999], GREEDY)))
    assert wide.stats()["failed"] == 1 and wide.stats()["running"] == 0


def test_a_server_that_is_down_fails_fast_naming_the_cell(fake: FakeSGLang) -> None:
    engine = sglang_engine(fake)
    fake.close()
    started = time.monotonic()
    with pytest.raises(
        SGLangServerError, match=rf"cell cell-7: SGLang server {fake.url}/generate is not reachable"
    ):
        asyncio.run(engine.generate(GenerateRequest("d", token_prompt(4), GREEDY)))
    with pytest.raises(SGLangServerError, match="cell cell-7.*release_memory_occupation is not reachable"):
        asyncio.run(engine.release_memory())
    assert time.monotonic() - started < 20 and engine.stats()["running"] == 0


def test_a_server_that_hangs_times_out_instead_of_hanging(fake: FakeSGLang) -> None:
    engine = sglang_engine(fake, timeout=1.5)
    fake.hang_generate = True
    started = time.monotonic()
    with pytest.raises(SGLangServerError, match="cell cell-7: SGLang server .*/generate timed out"):
        asyncio.run(engine.generate(GenerateRequest("h", token_prompt(4), GREEDY)))
    assert time.monotonic() - started < 20


def test_chunk_reader_tells_cumulative_from_delta_chunks() -> None:
    def chunk(entries, total):
        return {
            "meta_info": {
                "output_token_logprobs": [[-0.5, t, None] for t in entries],
                "completion_tokens": total,
            }
        }

    cumulative, delta = ChunkReader(), ChunkReader()
    assert cumulative.new_tokens(chunk([4, 5], 2)) == [(4, -0.5), (5, -0.5)]
    assert cumulative.new_tokens(chunk([4, 5, 6], 3)) == [(6, -0.5)]
    assert delta.new_tokens(chunk([4, 5], 2)) == [(4, -0.5), (5, -0.5)]
    assert delta.new_tokens(chunk([6], 3)) == [(6, -0.5)]
    with pytest.raises(ValueError, match="expected 9"):
        delta.new_tokens(chunk([7, 8], 9))


def test_make_engine_connects_to_a_configured_server(
    fake: FakeSGLang, model, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("GYRE_TEST_SGLANG_KEY", fake.api_key)
    options = SGLangOptions(url=fake.url, api_key_env="GYRE_TEST_SGLANG_KEY")
    section = EngineSection(backend="sglang", sglang=options)
    engine = make_engine(section, model, model.args, version=2, stop_token_ids=[], cell_id="cell-1")
    try:
        result = asyncio.run(engine.generate(GenerateRequest("mk", token_prompt(5), GREEDY)))
    finally:
        engine.shutdown()
    assert isinstance(engine, SGLangEngine) and engine.server is None and engine.cell_id == "cell-1"
    assert result.output_versions == [0] * 12  # the server's weight_version wins over the local guess


def test_a_rollout_cell_drains_an_sglang_request_to_a_torch_cell(fake: FakeSGLang, model) -> None:
    cell = RolloutCell("cell-s", lambda: sglang_engine(fake))
    target = RolloutCell("cell-t", lambda: small_engine(model))
    sampling = SamplingParams(temperature=0.0, max_new_tokens=40)
    prompt = token_prompt(6, start=9)

    async def scenario():
        await cell.setup()
        await target.setup()
        batches, task = await start_stream(cell.generate(GenerateRequest("c1", prompt, sampling)), 1)
        moved = await cell.drain()
        await task
        migrated = batches[-1]
        assert isinstance(migrated, Migrated) and migrated.state.kv is None
        rest = [e.token_id async for item in target.resume(migrated.state) if isinstance(item, TokenBatch)
                for e in item.events]  # fmt: skip
        first = [e.token_id for b in batches if isinstance(b, TokenBatch) for e in b.events]
        return moved, migrated.state, first, rest

    try:
        moved, state, first, rest = asyncio.run(scenario())
    finally:
        target.close()
    want = generate_alone(model, GenerateRequest("w", prompt, sampling))
    assert moved == 1 and first == state.output_ids
    assert state.output_ids + rest == want.output_ids


def test_launch_command_and_missing_pieces_are_explained() -> None:
    options = SGLangOptions(mem_fraction_static=0.5, extra_args=["--dtype", "float32"])
    command = launch_command(
        "/models/m",
        31234,
        options,
        gpu_count=2,
        max_running_requests=8,
        radix_cache=False,
        key_config="/k.yaml",
    )
    joined = " ".join(command)
    assert (
        "-m sglang.launch_server --model-path /models/m --host 127.0.0.1 --port 31234 --tp-size 2" in joined
    )
    assert "--skip-tokenizer-init" in command and "--enable-memory-saver" in command
    assert "--disable-radix-cache" in command and command[-2:] == ["--dtype", "float32"]
    assert "--max-running-requests 8" in joined and "--mem-fraction-static 0.5" in joined
    assert "--config /k.yaml" in joined
    with pytest.raises(ValueError, match="exceeds the bundle's 1 GPU"):
        launch_command("/m", 1, SGLangOptions(tp_size=2), gpu_count=1, max_running_requests=1, key_config="k")
    for flag in (
        "--api-key",
        "--admin-api-key=x",
        "--config",
        "--api-k=y",
        "--conf",
    ):  # prefixes too: the engine's key stays the only one
        with pytest.raises(ValueError, match=f"extra_args may not hold {flag.split('=')[0]}"):
            launch_command("/m", 1, SGLangOptions(extra_args=[flag, "x"]), 1, 1, key_config="k")
    if importlib.util.find_spec("sglang") is None:
        with pytest.raises(
            SGLangUnavailableError, match="cell cell-4: engine.backend=sglang needs the sglang"
        ):
            check_available("cell-4", ["0"])
    else:
        with pytest.raises(SGLangUnavailableError, match="cell cell-4: .*needs a CUDA GPU"):
            check_available("cell-4", [])


def test_an_abort_that_beats_the_request_to_the_server_still_stops_it(fake: FakeSGLang) -> None:
    engine = sglang_engine(fake)

    async def scenario():
        events, task = await start_stream(engine.stream(GenerateRequest("early", token_prompt(8), LONG)), 0)
        await asyncio.sleep(0)  # the request is registered; its HTTP call has not gone out yet
        assert engine.stats()["running"] == 1 and not fake.calls
        partial = await engine.abort("early")
        await asyncio.wait_for(task, 30)
        return partial, events

    partial, events = asyncio.run(scenario())
    assert partial is not None and partial.finish_reason == "abort" and len(partial.output_ids) < 400
    assert events[-1].finish_reason == "abort" and engine.stats()["running"] == 0


def test_an_abort_that_beat_the_request_is_sent_again_at_the_servers_first_answer(fake: FakeSGLang) -> None:
    # a retry period longer than the whole request (400 tokens, >= 2 s at 5 ms a token): only the
    # resend on the server's first chunk can stop it early
    engine = sglang_engine(fake, abort_retry_s=30.0, abort_wait_s=60.0)

    async def scenario():
        events, task = await start_stream(engine.stream(GenerateRequest("early", token_prompt(8), LONG)), 0)
        await asyncio.sleep(0)  # registered here, its HTTP call not out yet: the first abort beats it
        started = time.monotonic()
        partial = await engine.abort("early")
        await asyncio.wait_for(task, 30)
        return partial, events, time.monotonic() - started

    partial, events, took = asyncio.run(scenario())
    aborts = [body for route, body in fake.calls if route == "/abort_request"]
    assert partial is not None and partial.finish_reason == "abort"
    assert len(partial.output_ids) < LONG.max_new_tokens // 2 and took < 10, (len(partial.output_ids), took)
    assert len(aborts) == 2 and all(body == {"rid": "early"} for body in aborts)  # no retry-period resend
    assert events[-1].finish_reason == "abort"


def test_aborting_on_a_server_that_never_answers_gives_up_after_abort_wait(fake: FakeSGLang) -> None:
    engine = sglang_engine(fake, abort_wait_s=1.0)
    fake.hang_generate = True

    async def scenario():
        events, task = await start_stream(engine.stream(GenerateRequest("stuck", token_prompt(4), LONG)), 0)
        await asyncio.sleep(0.2)
        started = time.monotonic()
        partial = await engine.abort("stuck")
        await asyncio.wait_for(task, 10)
        return partial, events, time.monotonic() - started

    partial, events, took = asyncio.run(scenario())
    assert partial.output_ids == [] and partial.finish_reason == "abort" and took < 10
    assert [e.token_id for e in events] == [ABORT_TOKEN_ID]


def test_token_versions_follow_the_servers_spans() -> None:
    spans = [{"version": "3", "start": 0, "end": 2}, {"version": "4", "start": 2, "end": 5}]
    meta = {"weight_version": "4", "weight_versions": spans}
    assert token_versions(meta, 0, 5, default=0) == [3, 3, 4, 4, 4]
    assert token_versions(meta, 4, 1, default=0) == [4]
    assert token_versions({"weight_version": "7"}, 0, 2, default=0) == [7, 7]  # a server without spans
    assert token_versions({"weight_version": "default"}, 0, 1, default=2) == [
        2
    ]  # not ours: the engine's count


def test_a_request_moved_twice_keeps_its_prompt_and_all_its_output(fake: FakeSGLang, model) -> None:
    engine = sglang_engine(fake)
    sampling = SamplingParams(temperature=0.0, max_new_tokens=40)
    prompt = token_prompt(5, start=13)

    async def scenario():
        _, task = await start_stream(engine.stream(GenerateRequest("t1", prompt, sampling)), 3)
        first = await engine.export_kv("t1")
        await task
        _, task = await start_stream(engine.import_kv(first), 3)
        second = await engine.export_kv("t1")
        await task
        return first, second, [e.token_id async for e in engine.import_kv(second)]

    first, second, rest = asyncio.run(scenario())
    want = generate_alone(model, GenerateRequest("w", prompt, sampling))
    assert second.input_ids == prompt and second.sampling.max_new_tokens == 40
    assert second.output_ids[: len(first.output_ids)] == first.output_ids
    assert len(second.output_ids) == len(second.output_logprobs) == len(second.output_versions)
    assert second.output_ids + rest == want.output_ids


def test_the_server_refuses_a_caller_without_its_key_but_answers_health_checks(fake: FakeSGLang) -> None:
    for key in (None, "gyre-wrong"):
        stranger = SGLangEngine(
            SGLangClient(fake.url, "cell-x", api_key=key), vocab_size=fake.args.vocab_size, max_context=64
        )
        with pytest.raises(
            SGLangServerError, match=r"cell cell-x: .*/generate answered HTTP 401: Unauthorized"
        ):
            asyncio.run(stranger.generate(GenerateRequest("s", token_prompt(4), GREEDY)))
        with pytest.raises(SGLangServerError, match="abort_request answered HTTP 401"):
            asyncio.run(stranger.client.abort(None))
        with pytest.raises(SGLangServerError, match="release_memory_occupation answered HTTP 401"):
            asyncio.run(stranger.release_memory())
        with pytest.raises(SGLangServerError, match="update_weights_from_disk answered HTTP 401"):
            asyncio.run(stranger.client.update_weights_from_disk("/tmp", 9))
        with pytest.raises(SGLangServerError, match="get_server_info answered HTTP 401"):
            asyncio.run(stranger.client.server_info())
        assert asyncio.run(stranger.client.healthy())  # /health* stays open, as in SGLang
    assert not fake.calls  # nothing got past the key check
    assert fake.refused.count("/abort_request") == 2
    engine = sglang_engine(fake)  # the holder of the key
    assert asyncio.run(engine.client.server_info())["weight_version"] == "0"


def test_the_key_reaches_the_server_in_a_private_file_not_on_its_command_line(tmp_path: Path) -> None:
    key = new_api_key()
    assert key != new_api_key() and not key.startswith("-") and len(key) >= 40
    folder = tmp_path / "key"
    folder.mkdir(mode=0o700)
    key_file = write_key_config(key, folder)
    assert key_file.stat().st_mode & 0o777 == 0o600
    command = launch_command("/m", 1, SGLangOptions(), 1, 4, key_config=key_file)
    assert key not in " ".join(command)  # /proc/PID/cmdline is readable by every uid
    assert key_from_command(command) == key  # what SGLang's --config merge makes of it
    with pytest.raises(FileExistsError):  # never written into a file someone else left there
        write_key_config(key, folder)
    backing = small_engine(small_model())
    server = FakeSGLang(backing, api_key=key_from_command(command))
    try:
        client = SGLangClient(server.url, "cell-k", api_key=key)
        assert asyncio.run(client.server_info())["weight_version"] == "0"
        with pytest.raises(SGLangServerError, match="401"):
            asyncio.run(SGLangClient(server.url, "cell-k").server_info())
    finally:
        server.close()
        backing.shutdown()


def test_a_configured_servers_key_must_be_in_the_named_variable(
    model, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.delenv("GYRE_TEST_NO_KEY", raising=False)
    options = SGLangOptions(url="http://127.0.0.1:9", api_key_env="GYRE_TEST_NO_KEY")
    with pytest.raises(ValueError, match="cell cell-1: engine.sglang.api_key_env='GYRE_TEST_NO_KEY' names"):
        make_engine(EngineSection(backend="sglang", sglang=options), model, model.args, cell_id="cell-1")


HEALTH_SERVER = """
import http.server, sys
class Health(http.server.BaseHTTPRequestHandler):
    def do_GET(self):
        self.send_response(200 if self.path == "/health_generate" else 404)
        self.end_headers()
    def log_message(self, *args):
        pass
http.server.HTTPServer(("127.0.0.1", int(sys.argv[1])), Health).serve_forever()
"""


def test_a_started_server_is_waited_for_and_stopped_with_its_folders(tmp_path: Path) -> None:
    import sys

    from gyre_ray.ports import free_port

    port = free_port()
    owned = tmp_path / "model"
    owned.mkdir()
    key_dir = tmp_path / "key"
    key_dir.mkdir()
    key_file = write_key_config("gyre-k", key_dir)
    server = SGLangServer(
        [sys.executable, "-c", HEALTH_SERVER, str(port)], f"http://127.0.0.1:{port}", ["3"], "cell-9",
        [owned, key_dir], api_key="gyre-k", key_file=key_file,
    )  # fmt: skip
    server.start()
    try:
        server.wait_healthy(timeout_s=30, poll_s=0.1)
        assert not key_file.exists()  # read at start: gone once the server answers
        process = server.process
        assert process is not None and process.poll() is None
    finally:
        server.stop()
    assert process.poll() is not None and not owned.exists() and not key_dir.exists()
    server.stop()  # twice is fine


def test_the_server_reports_log_probs_under_the_policy_not_its_temperature() -> None:
    """SGLang reports log(softmax(logits / T)) unless SGLANG_RETURN_ORIGINAL_LOGPROB is set: every
    behaviour log-prob of a call at a temperature other than 0 and 1 was then the wrong policy's (the
    GSPO ratio and the reported KL off). The server now starts with it set, on its bundle's GPUs."""
    import sys

    probe = "import os; print(os.environ.get('SGLANG_RETURN_ORIGINAL_LOGPROB'), os.environ['CUDA_VISIBLE_DEVICES'])"
    server = SGLangServer([sys.executable, "-c", probe], "http://127.0.0.1:9", ["3", "5"], "cell-9", [])
    server.start()
    try:
        assert server.process is not None and server.process.wait(timeout=60) == 0
        assert server.log_tail().strip().splitlines()[-1] == "1 3,5"
    finally:
        server.stop()


def test_a_server_that_dies_while_starting_is_reported_with_its_log() -> None:
    import sys

    code = (  # SGLang logs its server_args, key included, before it fails
        "import sys; print(\"server_args={'api_key': 'gyre-s3cret'}\"); print('CUDA error: no device'); "
        "sys.exit(3)"
    )
    server = SGLangServer(
        [sys.executable, "-c", code], "http://127.0.0.1:9", ["0"], "cell-2", api_key="gyre-s3cret"
    )
    server.start()
    with pytest.raises(
        SGLangServerError, match=r"(?s)cell cell-2: the SGLang server exited with code 3.*no device"
    ) as failed:
        server.wait_healthy(timeout_s=30, poll_s=0.1)
    server.stop()
    assert "gyre-s3cret" not in str(failed.value) and "'api_key': '<api-key>'" in str(failed.value)


def test_a_cells_engine_factory_gives_sglang_the_folder_without_loading_the_weights(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    import gyre_ray.model
    from gyre_ray.cells.factories import PolicyEngineFactory
    from gyre_ray.engines.testing import small_args
    from gyre_ray.model.checkpoint import save_hf

    policy = small_model(args=small_args(vocab_size=8192))  # fits the default tokenizer
    folder = save_hf(policy, policy.args, tmp_path / "policy")
    backing = small_engine(small_model(args=small_args(vocab_size=8192)))
    server = FakeSGLang(backing)

    def no_weights(section):
        raise AssertionError("the policy's weights were loaded for an SGLang cell")

    monkeypatch.setattr(gyre_ray.model, "load_policy", no_weights)
    monkeypatch.setenv("GYRE_TEST_SGLANG_KEY", server.api_key)
    sglang = {"url": server.url, "api_key_env": "GYRE_TEST_SGLANG_KEY"}
    factory = PolicyEngineFactory({"path": str(folder)}, {"backend": "sglang", "sglang": sglang})
    try:
        engine = factory()
        request = GenerateRequest("pf", token_prompt(6), GREEDY)
        got = asyncio.run(engine.generate(request))
        engine.shutdown()
    finally:
        server.close()
        backing.shutdown()
    assert isinstance(engine, SGLangEngine) and engine.vocab_size == 8192
    assert got.output_ids == generate_alone(policy, request).output_ids
    assert engine.stop_token_ids  # the tokenizer's stop ids reach the server
