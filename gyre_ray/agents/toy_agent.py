"""A built-in toy agent harness for the CPU demo: a real OpenAI-API client with a branching history.

It talks to the proxy over the OpenAI chat-completions HTTP API (`gyre_ray.agents.chat_client`, the
SDK's request and response shapes on the standard library: the SDK's import alone cost a CPU-second
per harness process), like any black-box harness, and leaves the
kinds of branches long-horizon harnesses leave: a multi-turn main conversation with a tool
(write_file), a retried call, two sub-agents with their own system prompt, and a context compaction
(a summary call, then a fresh main conversation seeded by the summary). Roles are declared with
the `X-Gyre-Role` header. Its answer goes to `answer.txt` in the workspace, which the task's
evaluator scores.

Run as `python -m gyre_ray.agents.toy_agent` with OPENAI_BASE_URL, OPENAI_API_KEY,
GYRE_TASK_PROMPT and GYRE_WORKSPACE set (the agent runner sets them).
"""

from __future__ import annotations

import json
import os
import sys
import time
import zlib
from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING, Any, TypeVar

if TYPE_CHECKING:
    from gyre_ray.agents.chat_client import ChatClient

WRITE_FILE_TOOL = {
    "type": "function",
    "function": {
        "name": "write_file",
        "description": "Append text to answer.txt in the workspace.",
        "parameters": {
            "type": "object",
            "properties": {"text": {"type": "string", "description": "Text to append."}},
            "required": ["text"],
        },
    },
}
MAIN_SYSTEM = "You are a careful coding agent. Use write_file to save your answer."
SUB_SYSTEM = "You are a sub-agent. Answer the delegated question briefly."
SUMMARY_PROMPT = "Summarize the conversation so far for a fresh context."


class ToyAgent:
    """One execution of the toy harness."""

    def __init__(
        self,
        client: ChatClient,
        workspace: Path,
        task: str,
        seed: int,
        max_tokens: int = 16,
        top_p: float = 1.0,
        run_seed: int = 0,
    ) -> None:
        self.client = client
        self.top_p = top_p
        self.workspace = workspace
        self.task = task
        self.seed = seed
        self.max_tokens = max_tokens
        self.calls = 0
        self.sleeps = _tool_sleeps(workspace, run_seed)  # the longtail task set's builds and test runs

    def _tool_time(self) -> None:
        if self.sleeps:
            time.sleep(self.sleeps.pop(0))

    def _chat(self, messages: list[dict], role: str, tools: bool = True):
        self.calls += 1
        return self.client.chat.completions.create(
            model="policy",
            messages=messages,
            tools=[WRITE_FILE_TOOL] if tools else None,
            max_tokens=self.max_tokens,
            temperature=1.0,
            top_p=self.top_p,
            seed=self.seed + self.calls,
            extra_headers={"X-Gyre-Role": role},
        )

    def _write_answer(self, text: str) -> int:
        with open(self.workspace / "answer.txt", "a") as handle:
            handle.write(text + "\n")
        return len(text)

    def _act(self, messages: list[dict], message: Any) -> None:
        """Append the assistant message and run its tool calls (or save its text)."""
        entry: dict = {"role": "assistant", "content": message.content or ""}
        if message.tool_calls:
            entry["tool_calls"] = [tc.model_dump() for tc in message.tool_calls]
        messages.append(entry)
        self._tool_time()
        for call in message.tool_calls or []:
            try:
                text = str(json.loads(call.function.arguments or "{}").get("text", ""))
            except (json.JSONDecodeError, AttributeError):
                text = call.function.arguments or ""
            written = self._write_answer(text)
            messages.append({"role": "tool", "tool_call_id": call.id, "content": f"wrote {written} chars"})
        if not message.tool_calls:
            self._write_answer(message.content or "")
            messages.append({"role": "user", "content": "Saved. Improve the answer."})

    def run(self, turns: int = 2) -> None:
        """Main turns, a retry, two sub-agents, a compaction, then one more main turn."""
        messages = [{"role": "system", "content": MAIN_SYSTEM}, {"role": "user", "content": self.task}]
        for _ in range(turns):
            self._act(messages, self._chat(messages, "main").choices[0].message)
        # A retried call: the same input sent again (e.g. after a client-side timeout); the harness
        # keeps the second answer, the first stays a sibling branch in the tree.
        self._chat(messages, "main")
        self._act(messages, self._chat(messages, "main").choices[0].message)
        for question in ("Help with", "Double-check"):
            sub = self._chat(
                [
                    {"role": "system", "content": SUB_SYSTEM},
                    {"role": "user", "content": f"{question}: {self.task}"},
                ],
                "sub-agent",
                tools=False,
            )
            messages.append({"role": "user", "content": f"Sub-agent says: {sub.choices[0].message.content}"})
        summary = self._chat(
            messages + [{"role": "user", "content": SUMMARY_PROMPT}], "main-summary", tools=False
        )
        messages = [
            {"role": "system", "content": MAIN_SYSTEM},
            {"role": "user", "content": f"{self.task}\nSummary so far: {summary.choices[0].message.content}"},
        ]
        self._act(messages, self._chat(messages, "main").choices[0].message)
        time.sleep(sum(self.sleeps))  # tool time the harness had no step left for


def _tool_sleeps(workspace: Path, run_seed: int = 0) -> list[float]:
    """Per-tool-step sleeps from the schedule a `longtail` task seeds (none for other tasks).

    The run's seed (`run.seed`) shifts the schedule's own, so another seed draws other durations."""
    path = workspace / ".gyre_tool_sleeps.json"  # gyre_ray.envs.longtail.SCHEDULE_FILE
    if not path.is_file():
        return []
    from gyre_ray.envs.longtail import tool_sleeps  # numpy: only imported for longtail tasks

    schedule = json.loads(path.read_text())
    if run_seed:
        schedule["seed"] = int(schedule["seed"]) + run_seed
    return tool_sleeps(schedule, workspace.name)


def execution_seed(workspace_name: str, run_seed: int = 0) -> int:
    """The toy harness's base request seed: from the execution's name (its workspace folder), not the
    path, so the same execution of another run folder (a resumed run, a rerun) samples the same way,
    and so does a start again after its executor died (`r1.<name>`: the planned name's seed); a
    non-zero `run.seed` gives other draws (seed 0 keeps the name-only ones)."""
    from gyre_ray.agents.relaunch import planned_id

    name = planned_id(workspace_name)
    key = name if not run_seed else f"{run_seed}/{name}"
    return zlib.crc32(key.encode()) % 100_000


_Number = TypeVar("_Number", int, float)


class _EnvError(ValueError):
    """An environment variable the harness reads does not hold a number."""


def _env_number(name: str, default: str, kind: Callable[[str], _Number]) -> _Number:
    """`kind(os.environ[name])` (default if unset or empty), or `_EnvError` naming the variable."""
    raw = os.environ.get(name, "") or default
    try:
        return kind(raw)
    except ValueError:
        raise _EnvError(
            f"toy_agent: {name}={raw!r} is not {'an integer' if kind is int else 'a number'}"
        ) from None


def main() -> int:
    from gyre_ray.agents.chat_client import ChatClient

    workspace = Path(os.environ.get("GYRE_WORKSPACE", "."))
    task = os.environ.get("GYRE_TASK_PROMPT", "")
    if not task:
        print("toy_agent: GYRE_TASK_PROMPT is empty", file=sys.stderr)
        return 2
    try:
        run_seed = _env_number("GYRE_RUN_SEED", "0", int)
        max_tokens = _env_number("GYRE_TOY_MAX_TOKENS", "16", int)
        top_p = _env_number("GYRE_TOY_TOP_P", "1.0", float)
        turns = _env_number("GYRE_TOY_TURNS", "2", int)
    except _EnvError as exc:
        print(exc, file=sys.stderr)
        return 2
    seed = execution_seed(workspace.resolve().name, run_seed)
    client = ChatClient(os.environ.get("OPENAI_BASE_URL", ""), os.environ.get("OPENAI_API_KEY", ""), 600.0)
    agent = ToyAgent(
        client,
        workspace,
        task,
        seed,
        max_tokens=max_tokens,
        top_p=top_p,
        run_seed=run_seed,
    )
    agent.run(turns=turns)
    print(f"toy_agent: done after {agent.calls} model calls")
    return 0


if __name__ == "__main__":
    sys.exit(main())
