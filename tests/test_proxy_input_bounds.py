"""Inputs an agent controls that used to cost the proxy dearly or answer a 500 (in-process, scripted
engine): a long stop string (the held-back suffix was searched in time quadratic in the output: a
100,000-character one stalled a replica's other calls for minutes), over-long model names and session
ids (copied into every record), a Responses message whose role or text part is the wrong type, a
tool_choice naming a non-string, and JSON nested past Python's limit in a session id, a Codex header
or a tool call's arguments. Each is a 400 naming the field, or ignored where it only labels a call."""

from __future__ import annotations

import asyncio
import json

import pytest
from sdk_clients import scenario

from gyre_ray.cells.factories import ScriptedEngineFactory
from gyre_ray.model.config import ModelSection
from gyre_ray.proxy.codec import ChatCodec
from gyre_ray.proxy.local import build_local_proxy
from gyre_ray.proxy.openai_schema import SESSION_MAX_CHARS, STOP_STRING_MAX_CHARS
from gyre_ray.proxy.textgen import TextAssembler

CODEC = ChatCodec.for_model(ModelSection())
USER = [{"role": "user", "content": "hi"}]
DEEP = "[" * 100_000 + "]" * 100_000  # valid JSON, nested far past Python's recursion limit (a prefix of
# 3,000 characters is still far past it, and under the 4,096 a user_id may have)


@pytest.fixture(scope="module")
def proxy(tmp_path_factory):
    factory = ScriptedEngineFactory({"replies": [], "reply_length": 6})
    return asyncio.run(build_local_proxy(CODEC, factory, tmp_path_factory.mktemp("records")))


def _post(proxy, path: str, body: dict, headers: dict | None = None) -> tuple[list, list]:
    async def run(c, _):
        answers = []
        for extra in headers or [{}]:
            answer = await c.http.post(
                path, json=body, headers={"authorization": f"Bearer {c.openai.api_key}", **extra}
            )
            answers.append((answer.status_code, answer.json()))
        return answers

    return scenario(proxy, run)


def _error(answer: tuple[int, dict]) -> str:
    status, body = answer
    assert status == 400, answer
    error = body["error"]
    return error["message"] if isinstance(error, dict) else str(error)


def test_a_stop_string_longer_than_the_limit_is_a_400(proxy) -> None:
    long_stop = "Z" * (STOP_STRING_MAX_CHARS + 1)
    chat = {"model": "m", "messages": USER, "stop": [long_stop]}
    (answer,), records = _post(proxy, "/v1/chat/completions", chat)
    assert "stop" in _error(answer) and records == []
    (answer,), _ = _post(proxy, "/v1/completions", {"model": "m", "prompt": "hi", "stop": long_stop})
    assert "stop" in _error(answer)
    anthropic = {"model": "m", "max_tokens": 8, "messages": USER, "stop_sequences": [long_stop]}
    (answer,), _ = _post(proxy, "/v1/messages", anthropic)
    assert answer[0] == 400 and "stop_sequences" in json.dumps(answer[1])


def test_an_over_long_model_name_is_a_400(proxy) -> None:
    (answer,), records = _post(proxy, "/v1/chat/completions", {"model": "m" * 300, "messages": USER})
    assert "model" in _error(answer) and records == []


def test_text_that_may_start_a_stop_string_is_held_back_and_no_more() -> None:
    stream = TextAssembler(lambda ids: "".join(chr(i) for i in ids), frozenset(), ["abcab!", "zz"])
    assert stream.feed([ord(c) for c in "xxabca"]) == "xx"  # "abca" may begin "abcab!"
    assert stream.feed([ord(c) for c in "bz"]) == "abcab"  # "abcabz": only the "z" may begin "zz"
    assert stream.feed([ord(c) for c in "q"]) == "zq"
    assert stream.feed([ord(c) for c in "abcab!tail"]) == "" and stream.stopped
    assert stream.content == "xxabcabzq"


def test_an_over_long_or_too_deep_session_id_labels_no_session(proxy) -> None:
    over_cap = json.dumps({"session_id": "s1", "pad": "x" * 5000})  # a valid id, in a user_id over 4,096
    for user_id in (json.dumps({"session_id": "s" * (SESSION_MAX_CHARS + 1)}), DEEP[:3000], over_cap):
        body = {"model": "m", "max_tokens": 4, "messages": USER, "metadata": {"user_id": user_id}}
        (answer,), records = _post(proxy, "/v1/messages", body)
        assert answer[0] == 200, answer
        assert [r.session for r in records] == [None]
    responses = {"model": "m", "input": "hi", "max_output_tokens": 4}
    answers, records = _post(
        proxy, "/v1/responses", responses, headers=[{"session-id": "s" * 300}, {"session-id": "ok"}]
    )
    assert [a[0] for a in answers] == [200, 200] and [r.session for r in records] == [None, "ok"]


def test_wrong_types_in_a_responses_request_are_400s_naming_them(proxy) -> None:
    cases = {
        "input.0.role": {"input": [{"type": "message", "role": ["x"], "content": "hi"}]},
        "input.0.content.0": {"input": [{"role": "user", "content": [{"type": "input_text", "text": 5}]}]},
        "tool_choice": {
            "input": "hi",
            "tools": [{"type": "function", "name": "f", "parameters": {"type": "object"}}],
            "tool_choice": {"type": "function", "name": [1]},
        },
    }
    for field, request in cases.items():
        (answer,), records = _post(proxy, "/v1/responses", {"model": "m", **request})
        assert field in _error(answer) and "Traceback" not in json.dumps(answer[1]) and records == []


def test_json_nested_past_the_recursion_limit_is_not_a_500(proxy) -> None:
    codex = [{"x-codex-turn-metadata": DEEP[:5000]}]
    answers, _ = _post(
        proxy, "/v1/responses", {"model": "m", "input": "hi", "max_output_tokens": 4}, headers=codex
    )
    assert answers[0][0] == 200, answers
    call = {"id": "c1", "type": "function", "function": {"name": "f", "arguments": DEEP[:5000]}}
    messages = [*USER, {"role": "assistant", "content": None, "tool_calls": [call]},
                {"role": "tool", "tool_call_id": "c1", "content": "done"}]  # fmt: skip
    (answer,), _ = _post(proxy, "/v1/chat/completions", {"model": "m", "messages": messages, "max_tokens": 4})
    assert answer[0] == 200, answer
