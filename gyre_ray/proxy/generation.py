"""One call from first token to final outcome, shared by the OpenAI and Anthropic front ends.

`Generation` drives a `CallRun` through a `TextAssembler`: `start()` waits for the first tokens (so
a refusal still becomes a proper HTTP status), `text_deltas()` yields visible text as it arrives
(adding up to `Outcome.content`: the whitespace before a tool call is not shown),
and `finish()` parses tool calls, settles the finish reason and records the call with the splice
key of exactly what the client was shown. `abandon()` is for clients that went away mid-call.
"""

from __future__ import annotations

import contextlib
import json
import uuid
from collections.abc import AsyncIterator
from dataclasses import dataclass, field
from typing import Any, Literal

from gyre_ray.proxy.calls import CallRun
from gyre_ray.proxy.prompt import assistant_key
from gyre_ray.proxy.textgen import TextAssembler

Finish = Literal["stop", "length", "tool_calls", "stop_string", "abort"]


@dataclass
class ToolCallOut:
    id: str
    name: str
    arguments: dict[str, Any]

    @property
    def arguments_json(self) -> str:
        return json.dumps(self.arguments, ensure_ascii=False)


@dataclass
class Outcome:
    """What the client receives: visible text, tool calls and why generation ended."""

    content: str
    tool_calls: list[ToolCallOut] = field(default_factory=list)
    finish: Finish = "stop"
    stop_string: str | None = None
    prompt_tokens: int = 0
    completion_tokens: int = 0
    cached_tokens: int = 0  # prompt tokens served from the engine's prefix cache


class Generation:
    """Text and tool calls of one running call."""

    def __init__(
        self,
        service: Any,
        run: CallRun,
        parse_tools: bool,
        stop_strings: list[str],
        tool_id_prefix: str = "call_",
    ) -> None:
        self.service = service
        self.run = run
        self.parse_tools = parse_tools
        self.tool_id_prefix = tool_id_prefix
        codec = service.codec
        markers = [codec.tool_call_marker] if parse_tools else []
        self.text = TextAssembler(codec.decode, codec.stop_ids, stop_strings, markers)
        self._tokens = run.tokens()
        self._first: list[int] | None = None
        self.outcome: Outcome | None = None
        self._separator = ""  # whitespace before a tool-call marker, not shown unless the call fails to parse

    async def start(self) -> None:
        """Wait for the first tokens; routing and engine refusals raise ApiError here."""
        try:
            self._first = await self._tokens.__anext__()
        except StopAsyncIteration:
            self._first = []

    async def text_deltas(self) -> AsyncIterator[str]:
        """Visible text as it is generated (stops early at a stop string)."""
        batches = [self._first] if self._first else []
        self._first = None
        for ids in batches:
            delta = self.text.feed(ids)
            if delta:
                yield delta
        if not self.text.stopped:
            async for ids in self._tokens:
                delta = self.text.feed(ids)
                if delta:
                    yield delta
                if self.text.stopped:
                    break
        if self.text.stopped:
            await self.run.cancel()
            await self._tokens.aclose()
        delta = self.text.finish()
        if self.text.marker_at is not None and not self.text.stopped:
            # what is left before the marker is the template's separator (the assembler holds trailing
            # whitespace back): `finish` strips it from the content, so the stream does not show it
            kept = delta.rstrip()
            self._separator, delta = delta[len(kept) :], kept
        if delta:
            yield delta

    async def collect(self) -> str:
        """Run to the end; the whole visible text."""
        parts = [delta async for delta in self.text_deltas()]
        return "".join(parts)

    async def finish(self) -> Outcome:
        """Parse tool calls, settle the finish reason and record the call (returning once the record is
        durable, see `ProxyService.record_durably`). Call after text_deltas ends."""
        text = self.text
        content = text.content
        calls: list[ToolCallOut] = []
        tail = text.tail
        if tail:
            parsed = self.service.codec.parse(tail)
            calls = [ToolCallOut(self._tool_id(), c.name, c.arguments) for c in parsed.tool_calls]
            if not calls:  # malformed tool-call markup: the client gets it as text
                content = content + tail
            else:  # the template's separator before the first call is not part of the text
                content = content.rstrip()
        run = self.run
        if text.stopped:
            finish: Finish = "stop_string"
        elif calls:
            finish = "tool_calls"
        elif run.finish_reason == "length" and not run.call.meta.get("proxy_capped"):
            finish = "length"
        elif run.finish_reason == "abort":
            finish = "abort"
        else:
            finish = "stop"
        self.outcome = Outcome(
            content=content,
            tool_calls=calls,
            finish=finish,
            stop_string=text.stop_string,
            prompt_tokens=len(run.call.input_ids),
            completion_tokens=len(run.output_ids),
            cached_tokens=run.cached_tokens,
        )
        splice = None
        if finish != "stop_string" and finish != "abort":
            raw_calls = [{"function": {"name": c.name, "arguments": c.arguments}} for c in calls]
            splice = assistant_key(content, raw_calls)
        meta = {"tool_calls": len(calls), "stop_string": text.stop_string}
        await self.service.record_durably(run, splice, meta)
        return self.outcome

    def tail_text(self) -> str:
        """Text withheld as a possible tool call that did not parse as one (to be shown at the end),
        with the whitespace held before it: the stream then adds up to `Outcome.content`."""
        if self.outcome is None or self.outcome.tool_calls:
            return ""
        return self._separator + self.text.tail

    async def abandon(self, reason: str = "client_disconnected") -> None:
        """The call ends early (client gone, or an error): stop the engine and record what was generated."""
        if self.run.recorded:
            return
        if reason == "client_disconnected":
            self.service.counters["client_aborts"] += 1
        await self.run.cancel(wait=True)
        with contextlib.suppress(Exception):
            await self._tokens.aclose()
        await self.service.record_durably(self.run, None, {reason: True})

    def _tool_id(self) -> str:
        return self.tool_id_prefix + uuid.uuid4().hex[:24]
