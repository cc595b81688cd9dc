"""The proxy's HTTP APIs in-process (scripted engine): SDK compatibility, tools, TITO splicing, auth, limits.

The engine here is `ScriptedEngine`: canned replies (with real token ids) make the model "call" tools
and produce outputs whose text re-encodes to different ids, which a random tiny model cannot be made
to do on purpose. The same APIs over Ray Serve and the tiny model are in test_proxy_serve.py.
"""

from __future__ import annotations

import asyncio
import json
import time

import httpx
import openai
import pytest
from asgi_scope import json_post_scope
from sdk_clients import WEATHER_TOOL, scenario

from gyre_ray.cells.factories import ScriptedEngineFactory
from gyre_ray.model.config import ModelSection
from gyre_ray.proxy.codec import ChatCodec
from gyre_ray.proxy.config import ProxySection
from gyre_ray.proxy.local import build_local_proxy
from gyre_ray.proxy.prompt import ChatPrompt

CODEC = ChatCodec.for_model(ModelSection())
IM_END = CODEC.tokenizer.im_end_id
TOOL_CALL = '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>'
ODD_IDS = [t for ch in "Hello" for t in CODEC.encode(ch)] + CODEC.encode(
    " there"
)  # not what BPE would produce
REPLIES = [
    ("WEATHER_Q", CODEC.encode("Let me check.\n" + TOOL_CALL) + [IM_END]),
    ("SUNNY_R", CODEC.encode("It is sunny.") + [IM_END]),
    ("ODD_Q", ODD_IDS + [IM_END]),
    ("STOP_Q", CODEC.encode("alpha beta STOP gamma") + [IM_END]),
]
ANTHROPIC_TOOL = {"name": "get_weather", "input_schema": WEATHER_TOOL["function"]["parameters"]}


def _factory(**options):
    replies = [(CODEC.encode(trigger), reply) for trigger, reply in REPLIES]
    return ScriptedEngineFactory({"replies": replies, "reply_length": 12, **options})


@pytest.fixture(scope="module")
def proxy(tmp_path_factory):
    return asyncio.run(build_local_proxy(CODEC, _factory(), tmp_path_factory.mktemp("records")))


# ---- OpenAI ---------------------------------------------------------------------------------------------
def test_openai_chat_plain_streaming_and_not_is_recorded_token_exact(proxy):
    messages = [{"role": "system", "content": "be kind"}, {"role": "user", "content": "hello there"}]

    async def body(c, _):
        full = await c.openai.chat.completions.create(model="any-name", messages=messages, temperature=0)
        stream = await c.openai.chat.completions.create(
            model="any-name", messages=messages, stream=True, stream_options={"include_usage": True}
        )
        chunks = [chunk async for chunk in stream]
        return full, chunks

    (full, chunks), records = scenario(proxy, body)
    text = "".join(ch.choices[0].delta.content or "" for ch in chunks if ch.choices)
    assert full.choices[0].message.content == text != ""
    assert full.choices[0].finish_reason == "stop" and chunks[-1].usage.completion_tokens == 13
    assert [r.role for r in records] == ["main", "main"]
    expected_prompt = CODEC.prompt_ids(ChatPrompt(messages=messages))
    for record in records:
        assert record.input_ids == expected_prompt
        assert record.output_ids[-1] in CODEC.stop_ids and CODEC.decode(record.output_ids[:-1]) == text
        assert len(record.output_logprobs) == len(record.versions) == len(record.output_ids)
    assert full.usage.prompt_tokens == len(expected_prompt)


def test_openai_tool_call_round_trip_splices_the_recorded_call(proxy):
    async def body(c, _):
        first = await c.openai.chat.completions.create(
            model="m", messages=[{"role": "user", "content": "WEATHER_Q"}], tools=[WEATHER_TOOL]
        )
        call = first.choices[0].message.tool_calls[0]
        # the client re-sends the call with its arguments re-formatted: still the same turn
        assistant = {
            "role": "assistant",
            "content": first.choices[0].message.content,
            "tool_calls": [
                {
                    "id": call.id,
                    "type": "function",
                    "function": {"name": "get_weather", "arguments": '{ "city":"Paris" }'},
                }
            ],
        }
        messages = [
            {"role": "user", "content": "WEATHER_Q"},
            assistant,
            {"role": "tool", "tool_call_id": call.id, "content": "SUNNY_R"},
        ]
        stream = await c.openai.chat.completions.create(
            model="m", messages=messages, tools=[WEATHER_TOOL], stream=True
        )
        second = "".join([ch.choices[0].delta.content or "" async for ch in stream if ch.choices])
        return first, second

    (first, second), records = scenario(proxy, body)
    choice = first.choices[0]
    assert choice.finish_reason == "tool_calls" and choice.message.content == "Let me check."
    assert choice.message.tool_calls[0].function.name == "get_weather"
    assert json.loads(choice.message.tool_calls[0].function.arguments) == {"city": "Paris"}
    assert second == "It is sunny."
    one, two = records
    assert two.input_ids[: len(one.input_ids) + len(one.output_ids)] == one.input_ids + one.output_ids
    assert two.parent_call_id == one.call_id and two.meta["spliced_messages"] == 1


def test_openai_streamed_tool_calls_reassemble(proxy):
    async def body(c, _):
        stream = await c.openai.chat.completions.create(
            model="m", messages=[{"role": "user", "content": "WEATHER_Q"}], tools=[WEATHER_TOOL], stream=True
        )
        return [ch async for ch in stream]

    chunks, _ = scenario(proxy, body)
    text = "".join(ch.choices[0].delta.content or "" for ch in chunks)
    calls = [tc for ch in chunks for tc in (ch.choices[0].delta.tool_calls or [])]
    assert text == "Let me check." and len(calls) == 1  # as the non-streamed result
    assert calls[0].function.name == "get_weather" and json.loads(calls[0].function.arguments) == {
        "city": "Paris"
    }
    assert chunks[-1].choices[0].finish_reason == "tool_calls"


def test_reencoding_assistant_text_would_differ_but_records_keep_the_original_ids(proxy):
    assert CODEC.encode(CODEC.decode(ODD_IDS)) != ODD_IDS  # the premise: text -> ids is not the inverse

    async def body(c, _):
        first = await c.openai.chat.completions.create(
            model="m", messages=[{"role": "user", "content": "ODD_Q"}]
        )
        text = first.choices[0].message.content
        history = [{"role": "user", "content": "ODD_Q"}, {"role": "assistant", "content": text}]
        await c.openai.chat.completions.create(
            model="m", messages=[*history, {"role": "user", "content": "more"}]
        )
        blocks = [
            {"role": "user", "content": "ODD_Q"},
            {"role": "assistant", "content": [{"type": "text", "text": text}]},
        ]
        await c.anthropic.messages.create(
            model="claude", max_tokens=20, messages=[*blocks, {"role": "user", "content": "more"}]
        )
        return text

    text, records = scenario(proxy, body)
    assert text == "Hello there"
    first, via_openai, via_anthropic = records
    for later in (via_openai, via_anthropic):
        prefix = first.input_ids + first.output_ids
        assert later.input_ids[: len(prefix)] == prefix
        assert later.meta["spliced_messages"] == 1


def test_stop_strings_cut_the_text_and_are_reported(proxy):
    async def body(c, _):
        oa = await c.openai.chat.completions.create(
            model="m", messages=[{"role": "user", "content": "STOP_Q"}], stop=["STOP"]
        )
        an = await c.anthropic.messages.create(
            model="m",
            max_tokens=50,
            messages=[{"role": "user", "content": "STOP_Q"}],
            stop_sequences=["STOP"],
        )
        return oa, an

    (oa, an), records = scenario(proxy, body)
    assert oa.choices[0].message.content == "alpha beta " and oa.choices[0].finish_reason == "stop"
    assert (
        an.content[0].text == "alpha beta "
        and an.stop_reason == "stop_sequence"
        and an.stop_sequence == "STOP"
    )
    assert len(records) == 2 and all(r.meta["stop_string"] == "STOP" for r in records)


def test_text_completions_with_text_or_token_ids(proxy):
    async def body(c, _):
        by_text = await c.openai.completions.create(model="m", prompt="hello", max_tokens=5)
        by_ids = await c.openai.completions.create(model="m", prompt=[11, 12, 13], max_tokens=5)
        bad = await c.http.post(
            "/v1/completions", json={"model": "m", "prompt": [1, 99999]}, headers=c.openai.auth_headers
        )
        return by_text, by_ids, bad

    (by_text, by_ids, bad), records = scenario(proxy, body)
    assert by_text.choices[0].finish_reason == "length" and by_text.usage.completion_tokens == 5
    assert records[0].input_ids == CODEC.encode("hello") and records[1].input_ids == [11, 12, 13]
    assert bad.status_code == 400 and "prompt[1]" in bad.json()["error"]["message"]


# ---- Anthropic ----------------------------------------------------------------------------------------------
def test_anthropic_messages_with_tools_streaming_and_not(proxy):
    async def body(c, _):
        msg = await c.anthropic.messages.create(
            model="claude-x",
            max_tokens=8000,
            messages=[{"role": "user", "content": "WEATHER_Q"}],
            tools=[ANTHROPIC_TOOL],
        )
        async with c.anthropic.messages.stream(
            model="claude-x",
            max_tokens=100,
            messages=[{"role": "user", "content": "WEATHER_Q"}],
            tools=[ANTHROPIC_TOOL],
        ) as stream:
            kinds = [event.type async for event in stream]
            final = await stream.get_final_message()
        raw = await c.http.post(
            "/v1/messages?beta=true",
            json={
                "model": "m",
                "max_tokens": 30,
                "stream": True,
                "messages": [{"role": "user", "content": "hi"}],
            },
            headers={"x-api-key": c.anthropic.api_key},
        )
        return msg, kinds, final, raw

    (msg, kinds, final, raw), records = scenario(proxy, body)
    for m in (msg, final):
        assert m.stop_reason == "tool_use" and [b.type for b in m.content] == ["text", "tool_use"]
        assert m.content[0].text.strip() == "Let me check." and m.content[1].input == {"city": "Paris"}
    assert kinds[0] == "message_start" and kinds[-1] == "message_stop" and "content_block_stop" in kinds
    names = [line[7:] for line in raw.text.splitlines() if line.startswith("event: ")]
    assert names[:3] == ["message_start", "ping", "content_block_start"]
    assert names[-4:] == ["content_block_delta", "content_block_stop", "message_delta", "message_stop"]
    assert len(records) == 3 and all(r.meta["api"] == "anthropic-messages" for r in records)


def test_anthropic_count_tokens_matches_the_recorded_prompt(proxy):
    async def body(c, _):
        kwargs = {"model": "m", "system": "sys", "messages": [{"role": "user", "content": "hello"}]}
        counted = await c.anthropic.messages.count_tokens(**kwargs)
        await c.anthropic.messages.create(max_tokens=5, **kwargs)
        return counted

    counted, records = scenario(proxy, body)
    assert counted.input_tokens == len(records[0].input_ids)


# ---- auth, roles, admin ------------------------------------------------------------------------------------
def test_keys_name_executions_and_errors_keep_each_apis_shape(proxy):
    other = proxy.register_execution()
    admin = {"Authorization": f"Bearer {proxy.admin_token}"}

    async def body(c, execution_id):
        out = {}
        out["oa_missing"] = await c.http.post("/v1/chat/completions", json={})
        out["an_unknown"] = await c.http.post("/v1/messages", json={}, headers={"x-api-key": "gyre-nope"})
        mine = {"Authorization": f"Bearer {c.openai.api_key}"}
        out["own_records"] = await c.http.get(f"/gyre/executions/{execution_id}/records", headers=mine)
        out["other_records"] = await c.http.get(
            f"/gyre/executions/{other['execution_id']}/records", headers=mine
        )
        out["admin_with_key"] = await c.http.post("/gyre/executions", headers=mine)
        out["admin_records"] = await c.http.get(
            f"/gyre/executions/{other['execution_id']}/records", headers=admin
        )
        out["drain_unknown"] = await c.http.post("/gyre/cells/nope/drain", headers=admin)
        await c.openai.chat.completions.create(model="m", messages=[{"role": "user", "content": "hi"}])
        out["me"] = execution_id
        out["own_count"] = await c.http.get(f"/gyre/executions/{execution_id}", headers=mine)
        out["other_count"] = await c.http.get(f"/gyre/executions/{other['execution_id']}", headers=mine)
        out["admin_count"] = await c.http.get(f"/gyre/executions/{other['execution_id']}", headers=admin)
        out["unknown_count"] = await c.http.get("/gyre/executions/nobody", headers=admin)
        out["head"] = await c.http.head("/")
        out["nowhere"] = await c.http.get("/v2/nothing")
        return out

    out, _ = scenario(proxy, body)
    assert (
        out["oa_missing"].status_code == 401
        and out["oa_missing"].json()["error"]["type"] == "authentication_error"
    )
    assert out["an_unknown"].status_code == 401 and out["an_unknown"].json()["type"] == "error"
    assert out["own_records"].status_code == 200
    assert out["other_records"].status_code == 403
    assert out["admin_with_key"].status_code == 401
    assert out["admin_records"].status_code == 200
    assert out["drain_unknown"].status_code == 404
    # how many calls are recorded, as a runner asks it when its harness ends: own key or admin only
    assert out["own_count"].json() == {"execution_id": out["me"], "records": 1, "finished": False}
    assert out["other_count"].status_code == 403 and out["unknown_count"].status_code == 404
    assert out["admin_count"].json()["records"] == 0
    assert out["head"].status_code == 200
    assert out["nowhere"].status_code == 404 and "error" in out["nowhere"].json()


def test_role_header_is_recorded_and_an_unknown_role_is_a_400(proxy):
    async def body(c, _):
        await c.openai.chat.completions.create(
            model="m",
            messages=[{"role": "user", "content": "hi"}],
            extra_headers={"X-Gyre-Role": "sub-agent"},
        )
        with pytest.raises(openai.BadRequestError, match="X-Gyre-Role"):
            await c.openai.chat.completions.create(
                model="m",
                messages=[{"role": "user", "content": "hi"}],
                extra_headers={"X-Gyre-Role": "chief"},
            )

    _, records = scenario(proxy, body)
    assert [r.role for r in records] == ["sub-agent"]


def test_a_lone_surrogate_escape_is_a_400_while_an_escaped_pair_is_text(proxy):
    # Valid JSON (`"\ud800"`) that Python parses into a str the tokenizer cannot take: a 400, not a 500.
    lone = '"a \\ud800 b"'
    bodies = {
        "/v1/chat/completions": '{"model": "m", "max_tokens": 3, "messages": [{"role": "user", "content": %s}]}',
        "/v1/completions": '{"model": "m", "max_tokens": 3, "prompt": %s}',
        "/v1/messages": '{"model": "m", "max_tokens": 3, "messages": [{"role": "user", "content": %s}]}',
        "/v1/messages/count_tokens": '{"model": "m", "messages": [{"role": "user", "content": "x"}], "system": %s}',
    }

    async def body(c, _):
        key = {"x-api-key": c.anthropic.api_key, "content-type": "application/json"}
        out = {
            path: await c.http.post(path, content=template % lone, headers=key)
            for path, template in bodies.items()
        }
        pair = bodies["/v1/chat/completions"] % '"\\ud83d\\ude00"'  # json.dumps' escaping of an emoji
        out["pair"] = await c.http.post("/v1/chat/completions", content=pair, headers=key)
        return out

    out, records = scenario(proxy, body)
    for path in bodies:
        response = out[path]
        assert response.status_code == 400, (path, response.text)
        message = response.json()["error"]["message"]
        assert "surrogate" in message
        assert (response.json().get("type") == "error") == path.startswith("/v1/messages")
    assert out["pair"].status_code == 200
    assert len(records) == 1 and "\U0001f600" in CODEC.decode(records[0].input_ids)


# ---- limits -------------------------------------------------------------------------------------------------
def test_max_tokens_capped_to_context_and_over_long_prompts_rejected(tmp_path):
    small = ChatCodec(CODEC.tokenizer, context_length=64)
    lp = asyncio.run(build_local_proxy(small, _factory(), tmp_path, num_cells=1))

    async def body(c, _):
        ok = await c.openai.chat.completions.create(
            model="m", messages=[{"role": "user", "content": "hi"}], max_tokens=5000
        )
        with pytest.raises(openai.BadRequestError, match="context length is 64"):
            await c.openai.chat.completions.create(
                model="m", messages=[{"role": "user", "content": "word " * 100}]
            )
        huge = await c.http.post(
            "/v1/messages",
            json={"model": "m", "max_tokens": 10**12, "messages": [{"role": "user", "content": "hi"}]},
            headers={"x-api-key": c.anthropic.api_key},
        )
        with pytest.raises(openai.BadRequestError) as newer:  # the error names the field that was sent
            await c.openai.chat.completions.create(
                model="m", messages=[{"role": "user", "content": "hi"}], max_completion_tokens=10**12
            )
        return ok, huge, newer.value

    (ok, huge, newer), records = scenario(lp, body)
    assert huge.status_code == 400 and huge.json()["type"] == "error"
    assert "the most this proxy accepts" in huge.json()["error"]["message"]
    assert (
        newer.body["param"] == "max_completion_tokens"
        and "max_completion_tokens is 10" in newer.body["message"]
    )
    assert ok.choices[0].finish_reason == "stop"
    assert len(records[0].input_ids) + len(records[0].output_ids) <= 64


def test_concurrent_calls_per_execution_are_bounded(tmp_path):
    section = ProxySection(max_concurrent_per_execution=1, queue_timeout_s=0.3)
    lp = asyncio.run(
        build_local_proxy(CODEC, _factory(token_delay_s=0.05), tmp_path, num_cells=1, section=section)
    )

    async def body(c, _):
        async def call():
            return await c.http.post(
                "/v1/messages",
                json={"model": "m", "max_tokens": 20, "messages": [{"role": "user", "content": "hi"}]},
                headers={"x-api-key": c.anthropic.api_key},
            )

        return await asyncio.gather(call(), call())

    responses, records = scenario(lp, body)
    statuses = sorted(r.status_code for r in responses)
    assert statuses == [200, 429]
    limited = next(r for r in responses if r.status_code == 429).json()
    assert (
        limited["error"]["type"] == "rate_limit_error" and "1 calls in flight" in limited["error"]["message"]
    )
    assert len(records) == 1


def test_an_executions_own_record_reads_take_its_call_slots(tmp_path):
    """Code an agent left could open any number of whole-trajectory reads with its key, each a full
    copy in the store actor and the replica: its reads now take one of its call slots (the admin's
    do not)."""
    section = ProxySection(max_concurrent_per_execution=1, queue_timeout_s=0.3)
    lp = asyncio.run(
        build_local_proxy(CODEC, _factory(token_delay_s=0.05), tmp_path, num_cells=1, section=section)
    )

    async def body(c, execution_id):
        own = {"x-api-key": c.anthropic.api_key}
        path = f"/gyre/executions/{execution_id}/records"
        call = asyncio.ensure_future(c.http.post(
            "/v1/messages", json={"model": "m", "max_tokens": 20, "messages": [{"role": "user", "content": "hi"}]},
            headers=own,
        ))  # fmt: skip
        await asyncio.sleep(0.1)  # the call holds the one slot
        busy = await c.http.get(path, headers=own)
        admin = await c.http.get(path, headers={"Authorization": f"Bearer {lp.admin_token}"})
        await call
        after = await c.http.get(path, headers=own)
        return busy, admin, after

    (busy, admin, after), records = scenario(lp, body)
    assert busy.status_code == 429 and "1 calls in flight" in busy.json()["error"]["message"]
    assert admin.status_code == 200 and after.status_code == 200
    assert len(after.text.splitlines()) == len(records) == 1


def test_a_call_waiting_for_a_slot_has_its_body_left_unread(tmp_path):
    """The slot is taken before the body is read, so an execution that opens many calls holds at
    most its limit of bodies in the replica's memory (the others wait unread, then 429); count_tokens
    takes a slot too, and every slot comes back once its call ends."""
    section = ProxySection(max_concurrent_per_execution=1, queue_timeout_s=0.3)
    lp = asyncio.run(
        build_local_proxy(CODEC, _factory(token_delay_s=0.05), tmp_path, num_cells=1, section=section)
    )
    message = {"model": "m", "max_tokens": 20, "messages": [{"role": "user", "content": "hi"}]}
    pulled: list[str] = []

    async def body(c, _):
        headers = {"x-api-key": c.anthropic.api_key, "content-type": "application/json"}

        async def chunks(name: str):
            pulled.append(name)
            yield json.dumps(message).encode()

        async def call(name: str, path: str = "/v1/messages"):
            return await c.http.post(path, content=chunks(name), headers=headers)

        first = asyncio.create_task(call("first"))
        while "first" not in pulled:  # the first call holds the slot, its body read
            await asyncio.sleep(0.005)
        waiting = await call("waiting")
        counting = await call("counting", "/v1/messages/count_tokens")
        answered = await first
        after = await call("after")  # the slot came back with the first call's answer
        return waiting, counting, answered, after

    (waiting, counting, answered, after), records = scenario(lp, body)
    assert waiting.status_code == 429 and "1 calls in flight" in waiting.json()["error"]["message"]
    assert counting.status_code == 429
    assert pulled == ["first", "after"]  # neither refused call's body was read
    assert answered.status_code == 200 and after.status_code == 200
    assert len(records) == 2
    assert lp.service._inflight == {}  # no slot left held


def test_a_call_past_request_timeout_is_aborted_with_a_408(tmp_path):
    # 1 s into a 100-token reply (5 s): the first tokens (50 ms each) arrive before it even on a loaded
    # machine (at 0.3 s a CI run once timed out still waiting for them: a 408 with nothing generated,
    # so nothing recorded)
    section = ProxySection(request_timeout_s=1.0)
    factory = _factory(token_delay_s=0.05, reply_length=100)
    lp = asyncio.run(build_local_proxy(CODEC, factory, tmp_path, num_cells=1, section=section))

    async def body(c, _):
        return await c.http.post(
            "/v1/chat/completions",
            json={"model": "m", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 100},
            headers={"Authorization": f"Bearer {c.openai.api_key}"},
        )

    response, records = scenario(lp, body)
    assert response.status_code == 408 and "request_timeout_s" in response.json()["error"]["message"]
    assert len(records) == 1 and records[0].meta["finish_reason"] == "abort" and records[0].meta["failed"]
    assert 0 < len(records[0].output_ids) < 100  # what the engine made before the abort is kept
    assert all(cell.status()["inflight"] == 0 for cell in lp.cells.values())


def test_a_non_streaming_call_survives_a_drain_of_its_cell(tmp_path):
    lp = asyncio.run(
        build_local_proxy(CODEC, _factory(token_delay_s=0.01, reply_length=1000), tmp_path, num_cells=2)
    )
    body = {"model": "m", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 40, "temperature": 0}

    async def run(c, drain: bool):
        headers = {"Authorization": f"Bearer {c.openai.api_key}"}
        call = asyncio.create_task(c.http.post("/v1/chat/completions", json=body, headers=headers))
        if drain:
            await asyncio.sleep(0.15)
            busy = next(cid for cid, cell in lp.cells.items() if cell.status()["inflight"])
            assert await lp.service.drain(busy) == 1
            await lp.service.undrain(busy)
        return (await call).json()["choices"][0]["message"]["content"]

    undisturbed, _ = scenario(lp, lambda c, _: run(c, False))
    moved, records = scenario(lp, lambda c, _: run(c, True))
    assert moved == undisturbed
    assert records[0].meta["migrations"] == 1 and len(records[0].meta["cells"]) == 2


async def _asgi_call(app, path: str, api_key: str, pieces: list[bytes], gap_s: float, then_stop: bool):
    """One raw ASGI POST whose body arrives in `pieces` `gap_s` apart; with `then_stop` the last piece
    never comes (the receive waits forever, as a replica does for a body another one already took)."""
    scope = json_post_scope(path, {"host": "proxy", "x-api-key": api_key})
    queue = list(pieces)

    async def receive():
        if not queue:
            await asyncio.Event().wait()  # no more body, and no disconnect either
        await asyncio.sleep(gap_s)
        piece = queue.pop(0)
        return {"type": "http.request", "body": piece, "more_body": bool(queue) or then_stop}

    sent = []

    async def send(message):
        sent.append(message)

    started = asyncio.get_running_loop().time()
    await asyncio.wait_for(app(scope, receive, send), 30)
    head = next(m for m in sent if m["type"] == "http.response.start")
    body = b"".join(m.get("body", b"") for m in sent if m["type"] == "http.response.body")
    return (
        head["status"],
        dict(head["headers"]),
        json.loads(body),
        asyncio.get_running_loop().time() - started,
    )


def test_a_request_body_that_stops_arriving_is_a_retryable_503_not_a_hang(tmp_path):
    section = ProxySection(body_timeout_s=0.3)
    lp = asyncio.run(build_local_proxy(CODEC, _factory(), tmp_path, num_cells=1, section=section))
    created = lp.register_execution()
    whole = json.dumps({"model": "m", "max_tokens": 8, "messages": [{"role": "user", "content": "hi"}]})
    raw = whole.encode()
    halves = [raw[: len(raw) // 2], raw[len(raw) // 2 :]]

    async def main():
        stalled = await _asgi_call(lp.app, "/v1/messages", created["api_key"], halves[:1], 0.0, True)
        nothing = await _asgi_call(lp.app, "/v1/chat/completions", created["api_key"], [], 0.0, True)
        # a slow body that keeps coming (each piece within the bound, the whole past it) is served
        slow = await _asgi_call(lp.app, "/v1/messages", created["api_key"], halves, 0.2, False)
        return stalled, nothing, slow

    stalled, nothing, slow = asyncio.run(main())
    for status, headers, _, took in (stalled, nothing):
        assert status == 503 and headers[b"retry-after"] == b"1", (status, headers)
        assert 0.25 < took < 5, took
    assert stalled[2]["type"] == "error" and "stopped arriving" in stalled[2]["error"]["message"]
    assert nothing[2]["error"]["type"] == "service_unavailable"
    assert slow[0] == 200 and slow[3] > 0.3, slow
    assert len(lp.store.records(created["execution_id"])) == 1  # only the served call is recorded


def test_hopeless_prompts_are_refused_before_encoding_and_errors_name_the_field(proxy, monkeypatch):
    """A prompt that cannot fit is refused from its length in characters (encoding megabytes would hold
    the replica's event loop for seconds); errors name the field the client sent, in JSON's words."""
    huge_text = "x" * (CODEC.context_length * CODEC.longest_token_chars)
    encoded_lengths: list[int] = []
    original = type(proxy.service.codec.segments).encode
    monkeypatch.setattr(
        type(proxy.service.codec.segments),
        "encode",
        lambda self, text: encoded_lengths.append(len(text)) or original(self, text),
    )

    async def body(c, _):
        key = {"Authorization": f"Bearer {c.openai.api_key}"}
        user = [{"role": "user", "content": huge_text}]
        sent = {
            "chat": ("/v1/chat/completions", {"model": "m", "messages": user}),
            "completions": ("/v1/completions", {"model": "m", "prompt": huge_text}),
            "responses": ("/v1/responses", {"model": "m", "input": "hi", "max_output_tokens": 10**9}),
            "responses choice": ("/v1/responses", {"model": "m", "input": "hi", "tool_choice": "bogus"}),
            "anthropic any": (
                "/v1/messages",
                {"model": "m", "max_tokens": 4, "messages": [{"role": "user", "content": "hi"}],
                 "tool_choice": {"type": "any"}},
            ),
        }  # fmt: skip
        out = {
            name: await c.http.post(path, json=payload, headers=key) for name, (path, payload) in sent.items()
        }
        out["null"] = await c.http.post("/v1/chat/completions", content=b"null", headers=key)
        out["digits"] = await c.http.post(
            "/v1/chat/completions", content=b'{"max_tokens": ' + b"9" * 5000 + b"}", headers=key
        )
        return out

    out, _ = scenario(proxy, body)
    assert {name: r.status_code for name, r in out.items()} == dict.fromkeys(out, 400)
    errors = {name: r.json()["error"] for name, r in out.items()}
    assert (
        errors["chat"]["message"].startswith("the prompt is at least")
        and errors["chat"]["param"] == "messages"
    )
    assert errors["completions"]["message"].startswith("the prompt is at least")
    assert errors["completions"]["param"] == "prompt"
    assert max(encoded_lengths, default=0) < len(huge_text)  # the huge text was never encoded
    assert errors["responses"]["param"] == "max_output_tokens"
    assert errors["responses"]["message"].startswith("max_output_tokens is 1000000000")
    assert errors["responses choice"]["param"] == "tool_choice"
    assert errors["anthropic any"]["message"] == "tool_choice 'any' needs tools to choose from"
    assert errors["null"]["message"] == "the request body must be a JSON object, got null"
    assert errors["digits"]["message"] == "malformed JSON: a number has more than 4300 digits"


def test_bodies_that_used_to_fail_inside_the_proxy_are_400s(proxy):
    """Each of these reached a handler and ended in a 500 (one after the call had run and been
    recorded): raw surrogate bytes (not UTF-8), a number out of float range (the Responses API echoes
    `metadata` back, and JSON cannot hold inf), nesting deeper than the serialisers' recursion, a
    tool schema whose property type is not a string."""
    deep = b'{"model": "m", "input": "hi", "metadata": {"x": ' + b"[" * 400 + b"]" * 400 + b"}}"
    schema = {"type": "object", "properties": {"x": {"type": {}}}}
    bodies = {
        "raw surrogate": ("/v1/chat/completions", b'{"model": "m", "messages": [{"role": "user", "content": "hi \xed\xa0\x80"}]}'),
        "inf metadata": ("/v1/responses", b'{"model": "m", "input": "hi", "metadata": {"x": 1e400}}'),
        "deep": ("/v1/responses", deep),
        "unhashable type": ("/v1/chat/completions", json.dumps({
            "model": "m", "messages": [{"role": "user", "content": "hi"}],
            "tools": [{"type": "function", "function": {"name": "f", "parameters": schema}}],
        }).encode()),
    }  # fmt: skip

    async def body(c, _):
        key = {"Authorization": f"Bearer {c.openai.api_key}"}
        return {
            name: await c.http.post(path, content=raw, headers=key) for name, (path, raw) in bodies.items()
        }

    out, records = scenario(proxy, body)
    assert {name: r.status_code for name, r in out.items()} == dict.fromkeys(bodies, 400)
    errors = {name: r.json()["error"]["message"] for name, r in out.items()}
    assert errors["raw surrogate"].startswith("the request body is not UTF-8 text")
    assert errors["inf metadata"] == "malformed JSON: the number 1e400 is out of range"
    assert errors["deep"] == "malformed JSON: nested deeper than 100 levels"
    assert "unknown JSON-schema type {}" in errors["unhashable type"]
    assert records == []  # refused before any call ran


def test_options_the_proxy_does_not_serve_are_refused_by_name(proxy):
    """Asking for log-probs, best_of or a suffix is a 400 naming the option, never a silent null."""

    async def body(c, _):
        key = {"Authorization": f"Bearer {c.openai.api_key}"}
        chat = {"model": "m", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 2}
        asks = {
            "logprobs": ("/v1/chat/completions", {**chat, "logprobs": True}),
            "top_logprobs": ("/v1/chat/completions", {**chat, "top_logprobs": 2}),
            "completion logprobs": ("/v1/completions", {"model": "m", "prompt": "hi", "logprobs": 2}),
            "best_of": ("/v1/completions", {"model": "m", "prompt": "hi", "best_of": 3}),
            "suffix": ("/v1/completions", {"model": "m", "prompt": "hi", "suffix": "!"}),
            "plain": ("/v1/chat/completions", {**chat, "logprobs": False, "top_logprobs": 0}),
        }
        return {
            name: await c.http.post(path, json=payload, headers=key) for name, (path, payload) in asks.items()
        }

    out, _ = scenario(proxy, body)
    assert out.pop("plain").status_code == 200
    params = {name: (r.status_code, r.json()["error"]["param"]) for name, r in out.items()}
    assert params == {
        "logprobs": (400, "logprobs"), "top_logprobs": (400, "top_logprobs"),
        "completion logprobs": (400, "logprobs"), "best_of": (400, "best_of"), "suffix": (400, "suffix"),
    }  # fmt: skip


def test_calls_past_the_waiting_limit_get_their_429_at_once(tmp_path):
    """Past `max_waiting_per_execution` waiting calls, one more is refused at once (not after the
    queue timeout), and the waiting count comes back to nothing."""
    section = ProxySection(max_concurrent_per_execution=1, max_waiting_per_execution=1, queue_timeout_s=5.0)
    lp = asyncio.run(
        build_local_proxy(CODEC, _factory(token_delay_s=0.05), tmp_path, num_cells=1, section=section)
    )
    message = {"model": "m", "max_tokens": 20, "messages": [{"role": "user", "content": "hi"}]}

    async def body(c, _):
        headers = {"x-api-key": c.anthropic.api_key}

        async def call():
            return await c.http.post("/v1/messages", json=message, headers=headers)

        first = asyncio.create_task(call())
        while not lp.service._inflight:  # the first call holds the only slot
            await asyncio.sleep(0.005)
        second = asyncio.create_task(call())
        while not lp.service._waiting:  # the second waits for it
            await asyncio.sleep(0.005)
        started = time.monotonic()
        third = await call()
        refused_in = time.monotonic() - started
        return third, refused_in, await first, await second

    (third, refused_in, first, second), records = scenario(lp, body)
    assert third.status_code == 429 and "1 waiting" in third.json()["error"]["message"]
    assert third.headers.get("retry-after") and refused_in < 1.0  # not after queue_timeout_s (5 s)
    assert first.status_code == 200 and second.status_code == 200  # the waiting one got the slot
    assert len(records) == 2 and lp.service._waiting == {} and lp.service._inflight == {}


def test_a_stream_whose_client_leaves_before_its_body_starts_is_recorded_and_frees_its_slot(tmp_path):
    """A server speaking ASGI spec 2.3 (uvicorn) cancels a streaming response at once when the
    client disconnects, which can be before its body generator first runs: the call's tokens were
    then never recorded and its slot was held until garbage collection. Each such call is now
    stopped, recorded as `client_disconnected`, and its slot freed."""
    section = ProxySection(max_concurrent_per_execution=1)
    lp = asyncio.run(
        build_local_proxy(
            CODEC, _factory(token_delay_s=0.05, reply_length=100), tmp_path, num_cells=1, section=section
        )
    )
    created = lp.register_execution()
    user = [{"role": "user", "content": "hi"}]
    # (one API: every streaming route returns its events through the same `sse`; each such call
    # waits out ABORT_WAIT_S for a cell stream nothing reads)
    calls = {"/v1/chat/completions": {"model": "m", "messages": user, "stream": True, "max_tokens": 100}}

    async def leave_at_once(path: str, payload: dict) -> None:
        incoming = [{"type": "http.request", "body": json.dumps(payload).encode(), "more_body": False}]

        async def receive() -> dict:
            return incoming.pop(0) if incoming else {"type": "http.disconnect"}

        async def send(_message: dict) -> None:
            await asyncio.sleep(0)  # a real server's send yields: the disconnect is seen meanwhile

        scope = json_post_scope(path, {"authorization": f"Bearer {created['api_key']}"})
        await lp.app({**scope, "asgi": {"version": "3.0", "spec_version": "2.3"}}, receive, send)

    async def main() -> None:
        for path, payload in calls.items():
            await leave_at_once(path, payload)
        # the slot is free again: a plain call of the same execution is served (limit 1 in flight)
        transport = httpx.ASGITransport(app=lp.app)
        async with httpx.AsyncClient(transport=transport, base_url="http://proxy") as client:
            done = await client.post(
                "/v1/messages", json={"model": "m", "max_tokens": 4, "messages": user},
                headers={"x-api-key": created["api_key"]},
            )  # fmt: skip
        assert done.status_code == 200, done.text

    asyncio.run(main())
    records = lp.store.records(created["execution_id"])
    assert len(records) == 2
    assert [bool(r.meta.get("client_disconnected")) for r in records] == [True, False]
