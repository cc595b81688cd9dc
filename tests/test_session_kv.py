"""Waiting sessions keep their KV when their cell is drained, and every API reports cached prompt tokens.

Engine level: a cached prefix exported from one torch engine and imported into another makes the
next turn there prefill only its new tokens, with the same greedy output. Through the proxy's HTTP
app over two tiny-model cells: agents wait between calls, one cell is drained, and their next calls
on the other cell recompute <= 5% of their prompts (engine stats and `usage` agree), against a full
recompute with `transfer.migrate_sessions` off; greedy outputs are the same either way and as
without a drain. An engine that cannot export prefixes (the scripted one) re-prefills.
"""

from __future__ import annotations

import asyncio
import json
import os
from asyncio import run
from typing import Any

import httpx
import pytest

from gyre_ray.cells.cell import RolloutCell
from gyre_ray.cells.factories import PolicyEngineFactory, ScriptedEngineFactory
from gyre_ray.engines.base import GenerateRequest, PrefixState
from gyre_ray.engines.testing import GREEDY, small_model, token_prompt
from gyre_ray.model.config import ModelSection
from gyre_ray.proxy.codec import ChatCodec
from gyre_ray.proxy.local import build_local_proxy
from gyre_ray.runtime.cluster import start_local_ray
from gyre_ray.transfer.mooncake import mooncake_available

MOONCAKE_OK, MOONCAKE_WHY = mooncake_available()
needs_mooncake = pytest.mark.skipif(
    not MOONCAKE_OK and os.environ.get("CI") != "true", reason=f"Mooncake cannot load: {MOONCAKE_WHY}"
)

CODEC = ChatCodec.for_model(ModelSection())
AGENTS = 4


def test_an_exported_prefix_lets_another_engine_skip_the_prefill(new_engine) -> None:
    model = small_model()
    source, target, plain = (new_engine(model, prefix_cache_tokens=10_000) for _ in range(3))
    turn1 = token_prompt(60)
    first = run(source.generate(GenerateRequest("t1", turn1, GREEDY)))
    turn2 = turn1 + first.output_ids + token_prompt(5, start=300)
    state = run(source.export_prefix(turn1 + first.output_ids))
    assert isinstance(state, PrefixState) and state.tokens == (turn1 + first.output_ids)[:-1]
    assert state.kv["k.0"].shape[2] == len(state.tokens)
    assert run(target.import_prefix(state)) == len(state.tokens)
    moved = run(target.generate(GenerateRequest("t2", turn2, GREEDY)))
    stats = target.stats()
    assert moved.cached_tokens == len(state.tokens)
    assert stats["prefill_computed_tokens"] == len(turn2) - len(state.tokens) == 6
    assert stats["prefix_imported_tokens"] == len(state.tokens)
    assert moved.output_ids == run(plain.generate(GenerateRequest("t2", turn2, GREEDY))).output_ids
    assert plain.stats()["prefill_computed_tokens"] == len(turn2)  # without the import: all of it
    # nothing cached: nothing to export; KV of other weights (an older version) is not imported
    assert run(source.export_prefix(token_prompt(20, start=77))) is None
    stale = PrefixState(state.tokens, state.kv, version=state.version + 1)
    assert run(plain.import_prefix(stale)) == 0 and plain.stats()["prefix_imports_stale"] == 1


def _agent_messages(index: int) -> list[dict[str, Any]]:
    notes = " ".join(
        f"Note {index}.{j}: item {j} of agent {index} is worth {(j * 7 + index) % 97}." for j in range(28)
    )
    return [
        {"role": "system", "content": f"Agent {index}. {notes}"},
        {"role": "user", "content": "Start."},
    ]


async def _chat(http: httpx.AsyncClient, key: str, messages: list[dict[str, Any]]) -> dict[str, Any]:
    body = {"model": "tiny", "messages": messages, "max_tokens": 8, "temperature": 0}
    reply = await http.post("/v1/chat/completions", json=body, headers={"Authorization": f"Bearer {key}"})
    assert reply.status_code == 200, reply.text
    return reply.json()


def _sessions(tmp_path, migrate: bool, drain: bool) -> dict[str, Any]:
    """Four agents make one call each, wait, (cell-0 is drained), then make their next call."""
    factory = PolicyEngineFactory(engine={"prefix_cache_tokens": 100_000})

    async def scenario() -> dict[str, Any]:
        lp = await build_local_proxy(CODEC, factory, tmp_path, 2, transfer={"migrate_sessions": migrate})
        keys = [lp.register_execution()["api_key"] for _ in range(AGENTS)]
        histories = [_agent_messages(i) for i in range(AGENTS)]
        transport = httpx.ASGITransport(app=lp.app)
        async with httpx.AsyncClient(transport=transport, base_url="http://proxy") as http:
            firsts = [await _chat(http, key, h) for key, h in zip(keys, histories, strict=True)]
            pins = dict(lp.service.router.affinity)
            for history, first in zip(histories, firsts, strict=True):
                history += [first["choices"][0]["message"], {"role": "user", "content": "Go on."}]
            if drain:
                await lp.service.drain("cell-0")
            before = {cid: dict(cell.status()["engine"]) for cid, cell in lp.cells.items()}
            seconds = await asyncio.gather(*(_chat(http, k, h) for k, h in zip(keys, histories, strict=True)))
            after = {cid: dict(cell.status()["engine"]) for cid, cell in lp.cells.items()}
        statuses = {cid: cell.status() for cid, cell in lp.cells.items()}
        for cell in lp.cells.values():
            cell.close()
        moved = [i for i, eid in enumerate(pins.values()) if eid == "cell-0"] if drain else []
        delta = {
            cid: {k: after[cid][k] - before[cid][k] for k in ("prompt_tokens", "prefill_computed_tokens")}
            for cid in after
        }
        return {
            "firsts": firsts, "seconds": seconds, "moved": moved, "delta": delta,
            "statuses": statuses, "moves": lp.service.counters["session_moves"],
        }  # fmt: skip

    return run(scenario())


def _recomputed(usage: dict[str, Any]) -> float:
    return 1 - usage["prompt_tokens_details"]["cached_tokens"] / usage["prompt_tokens"]


@pytest.fixture(scope="module")
def runs(tmp_path_factory) -> dict[str, dict[str, Any]]:
    return {
        name: _sessions(tmp_path_factory.mktemp(name), migrate, drain)
        for name, migrate, drain in (
            ("migrated", True, True),
            ("reprefill", False, True),
            ("undisturbed", True, False),
        )
    }


def test_drained_sessions_take_their_kv_to_the_cell_they_move_to(runs) -> None:
    got = runs["migrated"]
    assert got["moved"] == [0, 2]  # affinity spread the agents; cell-0's two move to cell-1
    assert got["moves"] == 2
    sessions = got["statuses"]["cell-0"]["sessions"]
    assert sessions["staged"] == 2 and sessions["taken"] == 2 and sessions["held"] == 0
    imported = got["statuses"]["cell-1"]["sessions"]["imported_tokens"]  # less what cell-1 already held
    assert sessions["staged_tokens"] - 20 < imported <= sessions["staged_tokens"] and imported > 1000
    delta = got["delta"]["cell-1"]  # every second call ran there: the two that moved and the two at home
    assert delta["prompt_tokens"] > 4 * 600
    assert delta["prefill_computed_tokens"] <= 0.05 * delta["prompt_tokens"]
    assert got["delta"]["cell-0"]["prompt_tokens"] == 0
    for i in got["moved"]:
        assert _recomputed(got["seconds"][i]["usage"]) <= 0.05


def test_without_migration_the_moved_sessions_recompute_their_prompts(runs) -> None:
    base = runs["reprefill"]
    assert base["moved"] == [0, 2] and base["moves"] == 0
    assert base["statuses"]["cell-0"]["session_kv"] == "re-prefill"
    assert base["statuses"]["cell-0"]["sessions"]["staged"] == 0
    for i in base["moved"]:
        assert _recomputed(base["seconds"][i]["usage"]) > 0.9
    delta = base["delta"]["cell-1"]
    assert delta["prefill_computed_tokens"] > 0.45 * delta["prompt_tokens"]


def test_greedy_outputs_are_the_same_with_and_without_migration_or_drain(runs) -> None:
    def texts(name: str, which: str) -> list[str]:
        return [reply["choices"][0]["message"]["content"] for reply in runs[name][which]]

    assert texts("migrated", "firsts") == texts("reprefill", "firsts") == texts("undisturbed", "firsts")
    assert texts("migrated", "seconds") == texts("reprefill", "seconds") == texts("undisturbed", "seconds")


def test_usage_reports_cached_prompt_tokens_first_call_none(runs) -> None:
    got = runs["undisturbed"]
    firsts = [first["usage"]["prompt_tokens_details"]["cached_tokens"] for first in got["firsts"]]
    assert firsts[:2] == [0, 0]  # the first call on each cell; later agents share only "<system>Agent "
    assert all(0 < n < 10 for n in firsts[2:])
    for second in got["seconds"]:
        cached = second["usage"]["prompt_tokens_details"]["cached_tokens"]
        assert 0.95 * second["usage"]["prompt_tokens"] <= cached < second["usage"]["prompt_tokens"]


def test_an_engine_without_prefix_export_falls_back_to_re_prefill() -> None:
    async def scenario() -> tuple[dict[str, Any], Any]:
        cell = RolloutCell("c", ScriptedEngineFactory())
        await cell.setup()
        events = [e async for e in cell.generate(GenerateRequest("x/1", [5, 6, 7], GREEDY), session="x")]
        assert events and cell.status()["sessions"]["remembered"] == 1
        await cell.drain()
        return cell.status(), await cell.take_session("x")

    status, ticket = run(scenario())
    assert status["session_kv"] == "re-prefill" and status["sessions"]["staged"] == 0 and ticket is None


def test_a_finished_execution_is_no_longer_kept_for_a_drain(tmp_path) -> None:
    async def scenario() -> list[int]:
        lp = await build_local_proxy(CODEC, ScriptedEngineFactory(), tmp_path, num_cells=1)
        created = lp.register_execution()
        transport = httpx.ASGITransport(app=lp.app)
        async with httpx.AsyncClient(transport=transport, base_url="http://p") as http:
            await _chat(http, created["api_key"], _agent_messages(0))
        remembered = [lp.cells["cell-0"].status()["sessions"]["remembered"]]
        await lp.service.finish_execution(created["execution_id"])
        return remembered + [lp.cells["cell-0"].status()["sessions"]["remembered"]]

    assert run(scenario()) == [1, 0]


def _sse(text: str, event: str) -> list[dict[str, Any]]:
    """The payloads of the SSE events named `event`."""
    blocks = [b for b in text.split("\n\n") if b.startswith(f"event: {event}\n")]
    return [json.loads(b.split("data: ", 1)[1]) for b in blocks]


def _reply(api: str, reply: httpx.Response) -> tuple[dict[str, Any], str]:
    """(usage, visible text) of an Anthropic or Responses reply, streamed or not."""
    if api == "anthropic":
        body = reply.json()
        return body["usage"], body["content"][0]["text"]
    if api == "responses":
        body = reply.json()
        return body["usage"], body["output"][0]["content"][0]["text"]
    if api == "anthropic-stream":
        usage = _sse(reply.text, "message_start")[0]["message"]["usage"]
        deltas = _sse(reply.text, "content_block_delta")
        return usage, "".join(d["delta"].get("text", "") for d in deltas)
    ends = _sse(reply.text, "response.completed") + _sse(reply.text, "response.incomplete")
    usage = ends[0]["response"]["usage"]
    return usage, "".join(d["delta"] for d in _sse(reply.text, "response.output_text.delta"))


@pytest.mark.parametrize("api", ["anthropic", "anthropic-stream", "responses", "responses-stream"])
def test_anthropic_and_responses_usage_report_the_cache_hit_of_a_second_call(tmp_path, api: str) -> None:
    system = "Be brief. " + " ".join(f"Rule {j}: keep item {j} at {(j * 5) % 31}." for j in range(20))

    async def call(http: httpx.AsyncClient, key: str, turns: list[str], replies: list[str]) -> dict[str, int]:
        stream = api.endswith("stream")
        history: list[dict[str, Any]] = []
        for user, reply in zip(turns, [*replies, None], strict=False):
            history.append({"role": "user", "content": user})
            if reply is not None:
                history.append({"role": "assistant", "content": reply})
        if api.startswith("anthropic"):
            body = {"model": "tiny", "system": system, "messages": history, "max_tokens": 6, "stream": stream}
            path, keys = "/v1/messages", ("input_tokens", "cache_read_input_tokens")
        else:
            body = {"model": "tiny", "instructions": system, "input": history, "max_output_tokens": 6}
            body["stream"] = stream
            path, keys = "/v1/responses", ("input_tokens", "cached")
        reply = await http.post(path, json={**body, "temperature": 0}, headers={"x-api-key": key})
        assert reply.status_code == 200, reply.text
        usage, text = _reply(api, reply)
        if api.startswith("responses"):
            usage = {**usage, "cached": usage["input_tokens_details"]["cached_tokens"]}
        return {"input": usage[keys[0]], "cached": usage[keys[1]], "text": text}

    async def scenario() -> tuple[dict[str, Any], dict[str, Any]]:
        lp = await build_local_proxy(CODEC, PolicyEngineFactory(), tmp_path, num_cells=1)
        key = lp.register_execution()["api_key"]
        async with httpx.AsyncClient(transport=httpx.ASGITransport(app=lp.app), base_url="http://p") as http:
            first = await call(http, key, ["Hi."], [])
            second = await call(http, key, ["Hi.", "And then?"], [first["text"]])
        lp.cells["cell-0"].close()
        return first, second

    first, second = run(scenario())
    assert first["cached"] == 0
    prompt = second["input"] + second["cached"] if api.startswith("anthropic") else second["input"]
    assert second["cached"] > 0.8 * prompt  # the system prompt, the first turn and its reply


@pytest.fixture(scope="module")
def ray_cluster():
    import ray

    os.environ.setdefault("GLOG_minloglevel", "2")
    start_local_ray(num_cpus=2, include_dashboard=False, logging_level="WARNING")
    yield
    ray.shutdown()


@pytest.mark.slow
@pytest.mark.parametrize("backend", ["object_store", pytest.param("mooncake", marks=needs_mooncake)])
def test_a_drained_sessions_kv_moves_between_cell_actors_on_ray(ray_cluster, backend: str) -> None:
    from gyre_ray.cells.pool import CellPool
    from gyre_ray.proxy.clients import RayCellClient

    factory = PolicyEngineFactory(engine={"prefix_cache_tokens": 100_000})
    pool = CellPool.start(2, factory, 0.5, prefix=f"kv-{backend}", transfer={"kv": backend})
    try:
        a, b = (RayCellClient(cid, actor) for cid, actor in pool.actors.items())
        prompt = token_prompt(300, vocab_size=8192)

        async def scenario() -> tuple[Any, int]:
            first = [e async for e in a.generate(GenerateRequest("s/1", prompt, GREEDY), session="s")]
            outputs = [t.token_id for batch in first for t in batch.events]
            assert await a.drain() == 0  # nothing in flight: the waiting session is staged instead
            ticket = await a.take_session("s")
            nxt = prompt + outputs + token_prompt(7, start=900, vocab_size=8192)
            [_ async for _ in b.generate(GenerateRequest("s/2", nxt, GREEDY), session="s", prefix=ticket)]
            return ticket, len(nxt)

        ticket, prompt_tokens = run(scenario())
        assert ticket is not None and ticket.backend == backend and ticket.kind == "kv"
        status = run(b.status())
        assert status["sessions"]["imported_tokens"] == len(prompt) + GREEDY.max_new_tokens - 1
        assert status["engine"]["prefill_computed_tokens"] == 8  # the 7 new tokens and the last output
        assert status["engine"]["prompt_tokens"] == prompt_tokens
    finally:
        pool.shutdown()


def test_a_drain_stages_waiting_sessions_only_in_flight_ones_move_with_their_request() -> None:
    from gyre_ray.engines.base import SamplingParams
    from gyre_ray.engines.testing import small_engine

    async def scenario() -> tuple[int, dict[str, Any], Any, Any]:
        cell = RolloutCell("c", lambda: small_engine(prefix_cache_tokens=10_000))
        await cell.setup()
        for session in ("a", "b"):
            [
                _
                async for _ in cell.generate(
                    GenerateRequest(f"{session}/1", token_prompt(30), GREEDY), session
                )
            ]
        long = SamplingParams(temperature=0.0, max_new_tokens=900)
        stream = cell.generate(GenerateRequest("b/2", token_prompt(40), long), "b")
        await stream.__anext__()  # b's second call is generating
        moved = await cell.drain()
        rest = [event async for event in stream]
        status = cell.status()
        tickets = await cell.take_session("a"), await cell.take_session("b")
        cell.close()
        return moved, status, tickets, rest[-1]

    moved, status, (a, b), last = run(scenario())
    assert moved == 1 and type(last).__name__ == "Migrated"
    assert status["sessions"]["staged"] == 1 and a is not None and b is None
