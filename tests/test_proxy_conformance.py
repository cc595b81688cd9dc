"""API conformance of the proxy's OpenAI / Responses / Anthropic surfaces, in-process (scripted engine).

Each test pins one behaviour an SDK or the docs rely on: content the text-only policy cannot read is
a clear 400 (never silently dropped), `/v1/models` answers both SDKs, streamed and non-streamed
results are the same, options the proxy does not serve are refused or honoured exactly (the record
is what the client got).
"""

from __future__ import annotations

import asyncio
import json
from types import SimpleNamespace

import anthropic
import openai
import pytest
from sdk_clients import WEATHER_TOOL
from sdk_clients import scenario as run_scenario

from gyre_ray.cells.factories import ScriptedEngineFactory
from gyre_ray.model.config import ModelSection
from gyre_ray.proxy.codec import ChatCodec
from gyre_ray.proxy.errors import ApiError
from gyre_ray.proxy.local import build_local_proxy

CODEC = ChatCodec.for_model(ModelSection())
IM_END = CODEC.tokenizer.im_end_id
CLOSE_ID = CODEC.encode("</tool_call>")[0]


def _call(city: str) -> str:
    payload = json.dumps({"name": "get_weather", "arguments": {"city": city}})
    return f"<tool_call>\n{payload}\n</tool_call>"


REPLIES = [
    ("WEATHER_Q", "Let me check.\n" + _call("Paris")),
    ("PAR_Q", "Checking both.\n" + _call("Paris") + "\n" + _call("Rome")),
    ("BROKEN_Q", "Trying.\n<tool_call>\nnot json\n</tool_call>"),
    ("SPACES_Q", "It is sunny.  "),
    ("SUNNY_R", "It is sunny."),
    ("LONG_Q", " ".join(["word"] * 60)),
]
RESP_TOOL = {
    "type": "function",
    "name": "get_weather",
    **{k: WEATHER_TOOL["function"][k] for k in ("description", "parameters")},
}
ANTHROPIC_TOOL = {"name": "get_weather", "input_schema": WEATHER_TOOL["function"]["parameters"]}


@pytest.fixture(scope="module")
def proxy(tmp_path_factory):
    replies = [(CODEC.encode(t), CODEC.encode(r) + [IM_END]) for t, r in REPLIES]
    factory = ScriptedEngineFactory({"replies": replies, "reply_length": 12})
    return asyncio.run(build_local_proxy(CODEC, factory, tmp_path_factory.mktemp("records")))


def scenario(proxy, body):
    """Run `body(clients)` against a fresh execution; return (result, its records)."""
    return run_scenario(proxy, lambda clients, _execution_id: body(clients), http_sends_key=True)


def user(text: str) -> list[dict]:
    return [{"role": "user", "content": text}]


def sse_data(text: str) -> list[dict]:
    return [json.loads(line[6:]) for line in text.splitlines() if line.startswith("data: {")]


# ---- 1. Responses: non-text parts are a 400, not dropped ---------------------------------------------
NON_TEXT_PARTS = [
    {"type": "input_image", "image_url": "data:image/png;base64,AAAA"},
    {"type": "input_file", "file_id": "file-1"},
    {"type": "input_audio", "input_audio": {"data": "AA", "format": "wav"}},
]


@pytest.mark.parametrize("part", NON_TEXT_PARTS, ids=lambda p: p["type"])
def test_responses_non_text_parts_are_a_clear_400(proxy, part):
    kind = part["type"]
    in_message = [{"role": "user", "content": [{"type": "input_text", "text": "what is this?"}, part]}]
    in_output = [
        {"role": "user", "content": "x"},
        {"type": "function_call", "call_id": "c1", "name": "get_weather", "arguments": "{}"},
        {"type": "function_call_output", "call_id": "c1", "output": [part]},
    ]

    async def body(c):
        errors = []
        for items in (in_message, in_output):
            with pytest.raises(openai.BadRequestError) as info:
                await c.openai.responses.create(model="m", input=items, tools=[RESP_TOOL])
            errors.append(info.value.body)
        return errors

    errors, records = scenario(proxy, body)
    assert (
        errors[0]["message"] == f"input.0.content.1: {kind} parts are not supported by this text-only policy"
    )
    assert errors[0]["param"] == "input.0.content.1"
    assert (
        errors[1]["message"] == f"input.2.output.0: {kind} parts are not supported by this text-only policy"
    )
    assert records == []


# ---- 2 / 3. /v1/models: retrieve, and one shape both SDKs parse -------------------------------------
def test_models_retrieve_with_both_sdks(proxy):
    async def body(c):
        listed = await c.openai.models.list()
        name = listed.data[0].id
        return (
            name,
            await c.openai.models.retrieve(name),
            await c.anthropic.models.retrieve(name),
            await c.openai.models.retrieve("any-other-name"),
            (await c.http.get(f"/v1/models/{name}")).json(),
            (await c.http.get("/v1/models")).json(),
            (await c.http2.get(f"/v1/models/{name}")).status_code,  # no key
        )

    (name, oa, an, other, raw_one, raw_list, unauth), _ = scenario(proxy, body)
    assert name == CODEC.model_name
    assert oa.id == an.id == other.id == name and oa.object == "model" and an.type == "model"
    assert raw_one == raw_list["data"][0]
    assert unauth == 401


def test_models_list_satisfies_the_anthropic_and_openai_parsers(proxy):
    async def body(c):
        page = await c.anthropic.models.list()
        return (
            page,
            [m async for m in await c.anthropic.models.list()],
            await c.openai.models.list(),
            (await c.http.get("/v1/models")).json(),
        )

    (page, items, oa, raw), _ = scenario(proxy, body)
    name = CODEC.model_name
    model = page.data[0]
    assert model.id == name and model.type == "model" and model.display_name == name
    assert model.created_at.isoformat() == "1970-01-01T00:00:00+00:00"
    assert page.has_more is False and page.first_id == page.last_id == name
    assert [m.id for m in items] == [name]
    assert oa.data[0].id == name and oa.data[0].owned_by == "gyre-ray" and oa.data[0].created == 0
    assert raw["object"] == "list" and raw["has_more"] is False
    assert raw["data"][0]["created_at"] == "1970-01-01T00:00:00Z"


# ---- 4. /v1/completions streaming honours stream_options.include_usage -------------------------------
def test_completions_stream_sends_a_final_usage_chunk(proxy):
    async def body(c):
        full = await c.openai.completions.create(model="m", prompt="hello there", max_tokens=6)
        stream = await c.openai.completions.create(
            model="m", prompt="hello there", max_tokens=6, stream=True, stream_options={"include_usage": True}
        )
        chunks = [ch async for ch in stream]
        plain = await c.openai.completions.create(model="m", prompt="hello there", max_tokens=6, stream=True)
        return full, chunks, [ch async for ch in plain]

    (full, chunks, plain), _ = scenario(proxy, body)
    assert chunks[-1].choices == [] and chunks[-1].usage is not None
    assert chunks[-1].usage.model_dump() == full.usage.model_dump()
    assert chunks[-1].usage.completion_tokens == 6
    assert all(ch.usage is None for ch in chunks[:-1]) and all(ch.usage is None for ch in plain)


# ---- 5. parallel_tool_calls: false is honoured while sampling (record == what the client got) -------
def _assert_one_call_recorded(record, calls):
    assert len(calls) == 1 and json.loads(calls[0]) == {"city": "Paris"}
    assert record.output_ids[-1] == CLOSE_ID  # the engine stopped on the first call's closing tag
    assert "Rome" not in CODEC.decode(record.output_ids)
    assert record.meta["tool_calls"] == 1


def test_chat_parallel_tool_calls_false_stops_after_the_first_call(proxy):
    async def body(c):
        both = await c.openai.chat.completions.create(model="m", messages=user("PAR_Q"), tools=[WEATHER_TOOL])
        one = await c.openai.chat.completions.create(
            model="m", messages=user("PAR_Q"), tools=[WEATHER_TOOL], parallel_tool_calls=False
        )
        async with c.openai.chat.completions.stream(
            model="m", messages=user("PAR_Q"), tools=[WEATHER_TOOL], parallel_tool_calls=False
        ) as stream:
            streamed = await stream.get_final_completion()
        message = one.choices[0].message
        again = [
            *user("PAR_Q"),
            {
                "role": "assistant",
                "content": message.content,
                "tool_calls": [tc.model_dump(exclude_none=True) for tc in message.tool_calls],
            },
            {"role": "tool", "tool_call_id": message.tool_calls[0].id, "content": "SUNNY_R"},
        ]
        follow = await c.openai.chat.completions.create(model="m", messages=again, tools=[WEATHER_TOOL])
        return both, one, streamed, follow

    (both, one, streamed, follow), records = scenario(proxy, body)
    assert len(both.choices[0].message.tool_calls) == 2 and records[0].meta["tool_calls"] == 2
    for result, record in ((one, records[1]), (streamed, records[2])):
        choice = result.choices[0]
        assert choice.finish_reason == "tool_calls" and choice.message.content == "Checking both."
        _assert_one_call_recorded(record, [tc.function.arguments for tc in choice.message.tool_calls])
    # the one-call output splices back into the next prompt token-exact
    first, last = records[1], records[3]
    assert (
        last.input_ids[: len(first.input_ids) + len(first.output_ids)] == first.input_ids + first.output_ids
    )
    assert last.meta["spliced_messages"] == 1 and follow.choices[0].message.content == "It is sunny."


def test_responses_and_anthropic_single_tool_call_options_stop_after_the_first_call(proxy):
    async def body(c):
        resp = await c.openai.responses.create(
            model="m", input="PAR_Q", tools=[RESP_TOOL], parallel_tool_calls=False
        )
        msg = await c.anthropic.messages.create(
            model="m",
            max_tokens=200,
            messages=user("PAR_Q"),
            tools=[ANTHROPIC_TOOL],
            tool_choice={"type": "auto", "disable_parallel_tool_use": True},
        )
        return resp, msg

    (resp, msg), records = scenario(proxy, body)
    calls = [o.arguments for o in resp.output if o.type == "function_call"]
    assert resp.parallel_tool_calls is False and resp.output_text == "Checking both."
    _assert_one_call_recorded(records[0], calls)
    uses = [json.dumps(b.input) for b in msg.content if b.type == "tool_use"]
    assert msg.stop_reason == "tool_use"
    _assert_one_call_recorded(records[1], uses)


def test_parallel_tool_calls_false_is_a_400_where_the_tokenizer_cannot_stop_on_one_call():
    from gyre_ray.proxy.front import one_tool_call_stop

    tokenizer = SimpleNamespace(
        encode=lambda text: [11, 12],  # "</tool_call>" in pieces: nothing to stop on
        backend=SimpleNamespace(get_added_tokens_decoder=lambda: {}),
    )
    service = SimpleNamespace(codec=SimpleNamespace(tokenizer=tokenizer))
    assert one_tool_call_stop(service, None, True, "parallel_tool_calls") == []
    assert one_tool_call_stop(service, False, False, "parallel_tool_calls") == []  # no tools to call
    with pytest.raises(ApiError) as info:
        one_tool_call_stop(service, False, True, "parallel_tool_calls")
    assert info.value.status == 400 and info.value.param == "parallel_tool_calls"
    assert "parallel_tool_calls is not supported" in info.value.message


# ---- 6. streamed and non-streamed results are the same text -------------------------------------------
@pytest.mark.parametrize("trigger", ["WEATHER_Q", "PAR_Q", "BROKEN_Q", "SPACES_Q"])
def test_sdk_stream_accumulators_equal_the_non_streamed_results(proxy, trigger):
    async def body(c):
        kw = {"model": "m", "messages": user(trigger), "tools": [WEATHER_TOOL]}
        chat = await c.openai.chat.completions.create(**kw)
        async with c.openai.chat.completions.stream(**kw) as stream:
            chat_s = await stream.get_final_completion()
        rkw = {"model": "m", "input": trigger, "tools": [RESP_TOOL]}
        resp = await c.openai.responses.create(**rkw)
        async with c.openai.responses.stream(**rkw) as stream:
            resp_s = await stream.get_final_response()
        akw = {"model": "m", "max_tokens": 200, "messages": user(trigger), "tools": [ANTHROPIC_TOOL]}
        msg = await c.anthropic.messages.create(**akw)
        async with c.anthropic.messages.stream(**akw) as stream:
            msg_s = await stream.get_final_message()
        return chat, chat_s, resp, resp_s, msg, msg_s

    (chat, chat_s, resp, resp_s, msg, msg_s), records = scenario(proxy, body)
    full, streamed = chat.choices[0].message, chat_s.choices[0].message
    assert streamed.content == full.content
    assert [t.function.arguments for t in streamed.tool_calls or []] == [
        t.function.arguments for t in full.tool_calls or []
    ]
    assert resp_s.output_text == resp.output_text
    assert [(o.type, getattr(o, "arguments", None)) for o in resp_s.output] == [
        (o.type, getattr(o, "arguments", None)) for o in resp.output
    ]

    def blocks(m):
        return [(b.type, getattr(b, "text", None), getattr(b, "input", None)) for b in m.content]

    assert blocks(msg_s) == blocks(msg)
    if trigger == "SPACES_Q":  # trailing whitespace with no tool call is the model's text: kept
        assert full.content == "It is sunny.  "
    if trigger == "BROKEN_Q":  # markup that does not parse is text, separator included
        assert full.content == "Trying.\n<tool_call>\nnot json\n</tool_call>" and not full.tool_calls
    if trigger == "WEATHER_Q":
        assert full.content == "Let me check."
    assert len(records) == 6


def test_a_streamed_tool_call_turn_still_splices(proxy):
    async def body(c):
        async with c.openai.chat.completions.stream(
            model="m", messages=user("WEATHER_Q"), tools=[WEATHER_TOOL]
        ) as stream:
            first = (await stream.get_final_completion()).choices[0].message
        messages = [
            *user("WEATHER_Q"),
            {
                "role": "assistant",
                "content": first.content,
                "tool_calls": [tc.model_dump(exclude_none=True) for tc in first.tool_calls],
            },
            {"role": "tool", "tool_call_id": first.tool_calls[0].id, "content": "SUNNY_R"},
        ]
        return first, await c.openai.chat.completions.create(
            model="m", messages=messages, tools=[WEATHER_TOOL]
        )

    (first, second), (one, two) = scenario(proxy, body)
    assert first.content == "Let me check." and second.choices[0].message.content == "It is sunny."
    assert two.input_ids[: len(one.input_ids) + len(one.output_ids)] == one.input_ids + one.output_ids
    assert two.meta["spliced_messages"] == 1


# ---- 7. Responses objects: incomplete items, echoed instructions and tools ---------------------------
def test_responses_incomplete_item_status_and_echoed_request_fields(proxy):
    body_json = {
        "model": "m",
        "input": "LONG_Q",
        "max_output_tokens": 5,
        "instructions": "be kind",
        "tools": [RESP_TOOL],
    }

    async def body(c):
        full = (await c.http.post("/v1/responses", json=body_json)).json()
        raw = await c.http.post("/v1/responses", json={**body_json, "stream": True})
        return full, sse_data(raw.text)

    (full, events), _ = scenario(proxy, body)
    assert full["status"] == "incomplete" and full["incomplete_details"] == {"reason": "max_output_tokens"}
    assert [item["status"] for item in full["output"]] == ["incomplete"]
    assert full["instructions"] == "be kind" and full["tools"] == [RESP_TOOL]
    done = [e["item"]["status"] for e in events if e["type"] == "response.output_item.done"]
    last = events[-1]
    assert done == ["incomplete"] and last["type"] == "response.incomplete"
    assert last["response"]["output"][0]["status"] == "incomplete"
    assert events[0]["response"]["instructions"] == "be kind" and events[0]["response"]["tools"] == [
        RESP_TOOL
    ]


# ---- 8. chat / Anthropic: unreadable content and unserved options are clear 400s --------------------
@pytest.mark.parametrize(
    "part",
    [
        {"type": "image_url", "image_url": {"url": "data:image/png;base64,AAAA"}},
        {"type": "input_audio", "input_audio": {"data": "AA", "format": "wav"}},
    ],
    ids=lambda p: p["type"],
)
def test_chat_non_text_parts_are_a_clear_400(proxy, part):
    messages = [{"role": "user", "content": [{"type": "text", "text": "what is this?"}, part]}]

    async def body(c):
        with pytest.raises(openai.BadRequestError) as info:
            await c.openai.chat.completions.create(model="m", messages=messages)
        return info.value.body

    error, records = scenario(proxy, body)
    kind = part["type"]
    assert (
        error["message"] == f"messages.0.content.1: {kind} parts are not supported by this text-only policy"
    )
    assert error["param"] == "messages.0.content.1" and records == []


def test_anthropic_unknown_blocks_and_top_k_are_clear_400s(proxy):
    search = {
        "type": "search_result",
        "source": "s",
        "title": "t",
        "content": [{"type": "text", "text": "x"}],
    }
    in_message = [{"role": "user", "content": [search]}]
    in_result = [
        {"role": "user", "content": "x"},
        {
            "role": "assistant",
            "content": [{"type": "tool_use", "id": "t1", "name": "get_weather", "input": {}}],
        },
        {"role": "user", "content": [{"type": "tool_result", "tool_use_id": "t1", "content": [search]}]},
    ]

    async def body(c):
        errors = []
        for messages, extra in ((in_message, {}), (in_result, {}), (user("hi"), {"top_k": 1})):
            with pytest.raises(anthropic.BadRequestError) as info:
                await c.anthropic.messages.create(
                    model="m", max_tokens=5, messages=messages, tools=[ANTHROPIC_TOOL], extra_body=extra
                )
            errors.append(info.value.body["error"]["message"])
        with pytest.raises(anthropic.BadRequestError) as info:
            await c.anthropic.messages.count_tokens(model="m", messages=in_message)
        errors.append(info.value.body["error"]["message"])
        return errors

    errors, records = scenario(proxy, body)
    unsupported = "search_result blocks are not supported by this text-only policy"
    assert errors[0] == errors[3] == f"messages.0.content.0: {unsupported}"
    assert errors[1] == f"messages.2.content.0.content.0: {unsupported}"
    assert errors[2].startswith("top_k is not supported")
    assert records == []
