"""The Responses API (`POST /v1/responses`) through the official `openai` SDK: plain and streamed
calls, a function-call round trip spliced token-exact, and clear 4xx errors."""

from __future__ import annotations

import json

import httpx
import pytest
from openai import BadRequestError, OpenAI
from served_proxy import CODEC, ServedProxy

from gyre_ray.cells.factories import PolicyEngineFactory, ScriptedEngineFactory
from gyre_ray.proxy.config import ProxySection
from gyre_ray.proxy.responses_schema import ResponsesRequest

IM_END = CODEC.tokenizer.im_end_id
WEATHER_TOOL = {
    "type": "function",
    "name": "get_weather",
    "description": "Weather of a city.",
    "parameters": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]},
}
CALL = '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>'


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    served = ServedProxy(
        PolicyEngineFactory(), tmp_path_factory.mktemp("tiny"), ProxySection(max_output_tokens=12)
    )
    yield served
    served.close()


@pytest.fixture(scope="module")
def scripted(tmp_path_factory):
    replies = [
        (CODEC.encode("WEATHER_PLEASE"), CODEC.encode("Checking.\n" + CALL) + [IM_END]),
        (CODEC.encode(" sunny"), CODEC.encode("It is sunny in Paris.") + [IM_END]),
    ]
    factory = ScriptedEngineFactory({"replies": replies, "reply_length": 6})
    served = ServedProxy(factory, tmp_path_factory.mktemp("scripted"), ProxySection(max_output_tokens=80))
    yield served
    served.close()


def _client(served: ServedProxy) -> tuple[OpenAI, str]:
    created = served.proxy.register_execution()
    return OpenAI(base_url=served.base_url + "/v1", api_key=created["api_key"], max_retries=0), created[
        "execution_id"
    ]


def test_a_plain_response_is_the_recorded_output_of_the_rendered_prompt(tiny: ServedProxy) -> None:
    client, execution = _client(tiny)
    response = client.responses.create(
        model="policy", instructions="Be brief.", input="say hi", max_output_tokens=8, temperature=1.0
    )
    (record,) = tiny.proxy.store.records(execution)
    assert response.status in ("completed", "incomplete") and response.output[0].type == "message"
    prompt = ResponsesRequest.model_validate(tiny.bodies[-1]).to_prompt()
    assert record.input_ids == CODEC.prompt_ids(prompt)  # token-exact: the rendering of what was sent
    shown = CODEC.decode([t for t in record.output_ids if t not in CODEC.stop_ids])
    assert response.output_text == shown and len(record.output_ids) <= 8
    assert response.usage.input_tokens == len(record.input_ids)
    assert record.meta["api"] == "openai-responses" and record.role == "main"


def test_a_streamed_response_sends_the_documented_events(tiny: ServedProxy) -> None:
    client, execution = _client(tiny)
    events = list(client.responses.create(model="policy", input="count", max_output_tokens=6, stream=True))
    kinds = [e.type for e in events]
    assert kinds[:4] == [
        "response.created", "response.in_progress", "response.output_item.added", "response.content_part.added",
    ]  # fmt: skip
    assert kinds[-1] in ("response.completed", "response.incomplete")
    assert [e.sequence_number for e in events] == list(range(len(events)))
    text = "".join(e.delta for e in events if e.type == "response.output_text.delta")
    final = events[-1].response
    assert final.output_text == text and final.usage.output_tokens == len(
        tiny.proxy.store.records(execution)[0].output_ids
    )


def test_a_function_call_round_trip_is_spliced_from_the_recorded_tokens(scripted: ServedProxy) -> None:
    client, execution = _client(scripted)
    history = [{"role": "user", "content": "WEATHER_PLEASE for Paris"}]
    first = client.responses.create(model="policy", input=history, tools=[WEATHER_TOOL])
    calls = [item for item in first.output if item.type == "function_call"]
    assert [(c.name, json.loads(c.arguments)) for c in calls] == [("get_weather", {"city": "Paris"})]
    history += [item.model_dump(exclude_none=True) for item in first.output]
    history.append({"type": "function_call_output", "call_id": calls[0].call_id, "output": "weather: sunny"})
    events = list(client.responses.create(model="policy", input=history, tools=[WEATHER_TOOL], stream=True))
    assert events[-1].type == "response.completed"
    assert events[-1].response.output_text == "It is sunny in Paris."
    one, two = scripted.proxy.store.records(execution)
    assert two.input_ids[: len(one.input_ids) + len(one.output_ids)] == one.input_ids + one.output_ids
    assert two.parent_call_id == one.call_id and two.meta["spliced_messages"] == 1


def test_bad_requests_are_400s_in_the_openai_shape(scripted: ServedProxy) -> None:
    client, _ = _client(scripted)
    with pytest.raises(BadRequestError, match="previous_response_id is not supported"):
        client.responses.create(model="policy", input="x", previous_response_id="resp_1")
    with pytest.raises(BadRequestError, match="not supported"):
        client.responses.create(model="policy", input=[{"type": "web_search_call", "id": "w"}])
    with pytest.raises(BadRequestError, match="no user, assistant or tool turn"):
        client.responses.create(model="policy", input=[], instructions="only a system prompt")
    denied = httpx.post(scripted.base_url + "/v1/responses", json={"model": "p", "input": "x"})
    assert denied.status_code == 401 and denied.json()["error"]["type"] == "authentication_error"


def test_a_mid_stream_error_event_takes_the_streams_next_sequence_number() -> None:
    """A call that fails after some events ends its stream with an `error` event numbered after
    them (it used to say 0, out of order with the events before it)."""
    import asyncio
    from types import SimpleNamespace

    from gyre_ray.proxy.errors import ApiError
    from gyre_ray.proxy.front import sse
    from gyre_ray.proxy.responses_api import _Events

    events = _Events()

    async def stream():
        yield events("response.created")
        yield events("response.in_progress")
        raise ApiError(503, "cell-1 stopped serving the call without finishing it")

    async def abandon(*_):
        return None

    gen = SimpleNamespace(abandon=abandon, outcome=None)
    slot = SimpleNamespace(bind=lambda _: None, release=lambda: None)

    async def read() -> list[dict]:
        response = sse(stream(), gen, slot, events.error)
        chunks = [chunk async for chunk in response.body_iterator]
        return [json.loads(c.split("data: ", 1)[1]) for c in chunks]

    sent = asyncio.run(read())
    assert [e["sequence_number"] for e in sent] == [0, 1, 2]
    assert sent[2]["type"] == "error" and sent[2]["code"] == "server_error"
    assert sent[2]["message"] == "cell-1 stopped serving the call without finishing it"
