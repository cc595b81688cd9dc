"""Synthetic transcripts of the toy harness, rendered exactly as the proxy renders its calls.

`toy_transcripts` runs the real toy agent (`gyre_ray.agents.toy_agent.ToyAgent`) against a scripted
client instead of the proxy: every call the agent makes (main turns with the write_file tool, the
retry, two sub-agents, the compaction's summary, the turn after it) is validated by the proxy's own
request schema and rendered by the proxy's codec, and answered by a scripted reply: a write_file tool
call when tools are offered, plain text otherwise, its words drawn uniformly from a pool. Each call
becomes one (prompt ids, reply ids) pair; the reply ends with the stop token, as the engine's do.
"""

from __future__ import annotations

import json
import random
import tempfile
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from gyre_ray.agents.chat_client import Choice, Completion, Function, Message, ToolCall
from gyre_ray.agents.toy_agent import ToyAgent
from gyre_ray.envs.base import Task
from gyre_ray.model.chat_template import tool_call_text
from gyre_ray.proxy.codec import ChatCodec
from gyre_ray.proxy.openai_schema import ChatCompletionRequest


@dataclass
class Transcript:
    """One model call: the prompt the proxy would render and the reply to learn (stop id included)."""

    prompt_ids: list[int]
    reply_ids: list[int]


class ScriptedClient:
    """Stands in for the toy agent's HTTP client (`gyre_ray.agents.chat_client`): records each call."""

    def __init__(self, codec: ChatCodec, words: list[str], words_per_reply: int, rng: random.Random):
        self.codec = codec
        self.words = words
        self.words_per_reply = words_per_reply
        self.rng = rng
        self.transcripts: list[Transcript] = []
        self.chat = self  # the agent calls client.chat.completions.create
        self.completions = self

    def create(self, **request: Any) -> Completion:
        body = {k: v for k, v in request.items() if k not in ("extra_headers", "seed") and v is not None}
        prompt = ChatCompletionRequest.model_validate(body).to_prompt()
        text = " ".join(self.rng.choice(self.words) for _ in range(self.words_per_reply))
        if prompt.tools:
            call = ToolCall(
                f"call_{len(self.transcripts)}", Function("write_file", json.dumps({"text": text}))
            )
            reply, message = tool_call_text(call.model_dump()), Message("", [call])
        else:
            reply, message = text, Message(text)
        stop = self.codec.tokenizer.im_end_id
        self.transcripts.append(Transcript(self.codec.prompt_ids(prompt), [*self.codec.encode(reply), stop]))
        return Completion([Choice(message)])


def toy_transcripts(
    tasks: list[Task],
    codec: ChatCodec,
    *,
    executions: int,
    words: list[str],
    words_per_reply: int,
    turns: int,
    seed: int,
) -> list[Transcript]:
    """The calls of `executions` scripted toy-harness executions, cycling over `tasks`."""
    rng = random.Random(seed)
    client = ScriptedClient(codec, list(words), words_per_reply, rng)
    with tempfile.TemporaryDirectory(prefix="gyre-warmup-") as tmp:
        for i in range(executions):
            workspace = Path(tmp) / f"e{i}"
            workspace.mkdir()
            task = tasks[i % len(tasks)]
            ToyAgent(client, workspace, task.prompt, seed=i).run(turns=turns)
    return client.transcripts
