"""A small OpenAI chat-completions client on the standard library, for the toy harness.

The toy harness used the official `openai` SDK, whose import costs about one CPU-second per process:
16 harness processes starting at once spent some 8 s of a 2-core machine's ~20 s step importing it
(measured with py-spy on the default job). This client sends the same requests (`POST
{base_url}/chat/completions`, `Authorization: Bearer <key>`, JSON body, extra headers such as
`X-Gyre-Role`) with `urllib` and returns the few attributes the harness reads, under the SDK's names
(`client.chat.completions.create(...).choices[0].message.tool_calls[0].function.arguments`), so the
harness code is the same for it, the SDK and the warm-up's scripted client. The proxy's
compatibility with the SDK itself is tested with the SDK (tests/test_proxy_api.py and others).

Like the SDK (`max_retries=2`), it sends a call again after a 429 or a 503, the two answers the
proxy calls retryable (no routable cell, a cell's queue full, a replica lost mid-call: nothing was
generated for the harness), after the answer's `Retry-After` (at most `MAX_RETRY_WAIT_S`; 0.5 s,
then 1 s, where it gives none). Other errors and time-outs are raised at once.
"""

from __future__ import annotations

import itertools
import json
import time
import urllib.error
import urllib.request
from dataclasses import dataclass, field
from typing import Any

RETRYABLE_STATUSES = (429, 503)
MAX_RETRIES = 2
MAX_RETRY_WAIT_S = 30.0


def retry_wait_s(retry_after: str | None, attempt: int) -> float:
    """Seconds to wait before retry `attempt` (0-based): the server's `Retry-After` seconds, capped,
    else 0.5 s doubling."""
    try:
        wait = float(retry_after) if retry_after is not None else None
    except ValueError:
        wait = None
    if wait is None or not wait >= 0:
        wait = 0.5 * 2**attempt
    return min(wait, MAX_RETRY_WAIT_S)


@dataclass
class Function:
    name: str
    arguments: str


@dataclass
class ToolCall:
    id: str
    function: Function
    type: str = "function"

    def model_dump(self) -> dict[str, Any]:
        return {"id": self.id, "type": self.type, "function": vars(self.function)}


@dataclass
class Message:
    content: str
    tool_calls: list[ToolCall] = field(default_factory=list)


@dataclass
class Choice:
    message: Message
    finish_reason: str | None = None


@dataclass
class Completion:
    choices: list[Choice]


class ChatAPIError(RuntimeError):
    """The server answered with an error status (or not at all); the message carries its body."""

    def __init__(self, status: int | None, detail: str) -> None:
        super().__init__(f"chat completion failed ({status or 'no answer'}): {detail}")
        self.status = status


def completion_from_json(body: dict[str, Any]) -> Completion:
    """The attributes the harness reads, from an OpenAI chat-completion response body."""
    choices = []
    for choice in body.get("choices") or []:
        raw = choice.get("message") or {}
        calls = [
            ToolCall(
                str(call.get("id", "")),
                Function(str(call["function"].get("name", "")), str(call["function"].get("arguments") or "")),
                str(call.get("type", "function")),
            )
            for call in raw.get("tool_calls") or []
            if isinstance(call, dict) and isinstance(call.get("function"), dict)
        ]
        choices.append(Choice(Message(raw.get("content") or "", calls), choice.get("finish_reason")))
    if not choices:
        raise ChatAPIError(200, f"a response without choices: {json.dumps(body)[:300]}")
    return Completion(choices)


class ChatClient:
    """`client.chat.completions.create(**request)` over HTTP, as the SDK does it (retries included)."""

    def __init__(
        self, base_url: str, api_key: str, timeout_s: float = 600.0, max_retries: int = MAX_RETRIES
    ) -> None:
        if not base_url:
            raise ValueError("base_url is empty (the runner sets OPENAI_BASE_URL)")
        self.url = base_url.rstrip("/") + "/chat/completions"
        self.api_key = api_key
        self.timeout_s = timeout_s
        self.max_retries = max_retries
        self.chat = self  # the SDK's path: client.chat.completions.create
        self.completions = self

    def create(self, *, extra_headers: dict[str, str] | None = None, **request: Any) -> Completion:
        body = {k: v for k, v in request.items() if v is not None}  # the SDK leaves unset fields out
        headers = {
            "Content-Type": "application/json",
            "Authorization": f"Bearer {self.api_key}",
            **(extra_headers or {}),
        }
        data = json.dumps(body).encode()
        for attempt in itertools.count():
            req = urllib.request.Request(self.url, data, headers, method="POST")
            try:
                with urllib.request.urlopen(req, timeout=self.timeout_s) as response:
                    return completion_from_json(json.loads(response.read()))
            except urllib.error.HTTPError as error:
                detail = error.read().decode(errors="replace")[:500]
                if error.code not in RETRYABLE_STATUSES or attempt == self.max_retries:
                    raise ChatAPIError(error.code, detail) from None
                time.sleep(retry_wait_s(error.headers.get("Retry-After"), attempt))
            except (urllib.error.URLError, TimeoutError, ConnectionError) as error:
                raise ChatAPIError(None, str(error)) from None
