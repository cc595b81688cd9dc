"""The toy harness's stdlib chat client: the request the SDK would send, the SDK's response shape, errors."""

from __future__ import annotations

import json
import threading
from collections.abc import Iterator
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import pytest

from gyre_ray.agents.chat_client import (
    MAX_RETRY_WAIT_S,
    ChatAPIError,
    ChatClient,
    completion_from_json,
    retry_wait_s,
)

TOOL_REPLY = {
    "id": "chatcmpl-1",
    "choices": [
        {
            "index": 0,
            "finish_reason": "tool_calls",
            "message": {
                "role": "assistant",
                "content": None,
                "tool_calls": [
                    {"id": "call_0", "type": "function",
                     "function": {"name": "write_file", "arguments": '{"text": "hour day"}'}},
                ],
            },
        }
    ],
}  # fmt: skip


class _Server(ThreadingHTTPServer):
    seen: list[tuple[str, dict[str, str], dict]]
    reply: tuple[int, bytes]
    first: list[tuple[int, bytes, dict[str, str]]]  # answers given before `reply`, in order


class _Handler(BaseHTTPRequestHandler):
    server: _Server

    def do_POST(self) -> None:  # noqa: N802 (http.server's name)
        body = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
        self.server.seen.append((self.path, dict(self.headers), body))
        status, payload, extra = self.server.first.pop(0) if self.server.first else (*self.server.reply, {})
        self.send_response(status)
        for name, value in extra.items():
            self.send_header(name, value)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(payload)))
        self.end_headers()
        self.wfile.write(payload)

    def log_message(self, *args: object) -> None:
        pass


@pytest.fixture()
def server() -> Iterator[_Server]:
    srv = _Server(("127.0.0.1", 0), _Handler)
    srv.seen, srv.reply, srv.first = [], (200, json.dumps(TOOL_REPLY).encode()), []
    thread = threading.Thread(target=srv.serve_forever, daemon=True)
    thread.start()
    yield srv
    srv.shutdown()
    srv.server_close()


def _client(srv: _Server) -> ChatClient:
    return ChatClient(f"http://127.0.0.1:{srv.server_address[1]}/v1/", "key-abc", timeout_s=10)


def test_sends_what_the_sdk_sends_and_reads_its_shape(server: _Server) -> None:
    reply = _client(server).chat.completions.create(
        model="policy", messages=[{"role": "user", "content": "hi"}], tools=None, max_tokens=8, seed=3,
        extra_headers={"X-Gyre-Role": "sub-agent"},
    )  # fmt: skip
    path, headers, body = server.seen[0]
    assert path == "/v1/chat/completions"
    assert headers["Authorization"] == "Bearer key-abc" and headers["X-Gyre-Role"] == "sub-agent"
    assert body == {
        "model": "policy",
        "messages": [{"role": "user", "content": "hi"}],
        "max_tokens": 8,
        "seed": 3,
    }
    message = reply.choices[0].message
    assert message.content == "" and reply.choices[0].finish_reason == "tool_calls"
    (call,) = message.tool_calls
    assert call.function.name == "write_file" and json.loads(call.function.arguments) == {"text": "hour day"}
    assert call.model_dump() == TOOL_REPLY["choices"][0]["message"]["tool_calls"][0]


def test_an_error_status_raises_with_the_servers_message(server: _Server) -> None:
    server.reply = (401, b'{"error": {"message": "unknown API key"}}')
    with pytest.raises(ChatAPIError, match="401.*unknown API key") as caught:
        _client(server).create(model="policy", messages=[])
    assert caught.value.status == 401


def test_no_server_and_no_choices_are_errors_not_hangs() -> None:
    with pytest.raises(ChatAPIError, match="no answer"):
        ChatClient("http://127.0.0.1:9/v1", "k", timeout_s=5).create(model="policy", messages=[])
    with pytest.raises(ChatAPIError, match="without choices"):
        completion_from_json({"choices": []})
    with pytest.raises(ValueError, match="OPENAI_BASE_URL"):
        ChatClient("", "k")


def test_a_429_or_503_is_sent_again_after_retry_after_as_the_sdk_does(server: _Server) -> None:
    busy = b'{"error": {"message": "no routable cell"}}'
    server.first = [(503, busy, {"Retry-After": "0"}), (429, busy, {"Retry-After": "0.01"})]
    reply = _client(server).create(model="policy", messages=[{"role": "user", "content": "hi"}])
    assert reply.choices[0].finish_reason == "tool_calls"
    assert len(server.seen) == 3 and server.seen[0][2] == server.seen[2][2]  # the same call each time


def test_retries_stop_after_two_and_other_errors_are_not_retried(server: _Server) -> None:
    busy = b'{"error": {"message": "no routable cell"}}'
    server.first = [(503, busy, {"Retry-After": "0"})] * 3
    with pytest.raises(ChatAPIError, match="503.*no routable cell"):
        _client(server).create(model="policy", messages=[])
    assert len(server.seen) == 3  # the call and two retries
    server.seen.clear()
    server.first = [(500, b'{"error": {"message": "boom"}}', {})]
    with pytest.raises(ChatAPIError, match="500.*boom"):
        _client(server).create(model="policy", messages=[])
    assert len(server.seen) == 1


def test_retry_waits_follow_retry_after_within_a_cap() -> None:
    assert retry_wait_s("2", 0) == 2.0 and retry_wait_s("0", 1) == 0.0
    assert retry_wait_s(None, 0) == 0.5 and retry_wait_s("soon", 1) == 1.0 and retry_wait_s("-3", 0) == 0.5
    assert retry_wait_s("3600", 0) == MAX_RETRY_WAIT_S
