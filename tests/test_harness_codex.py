"""The real Codex CLI (`codex exec`, the version pinned in the Makefile) as a harness: through the
proxy's Responses API, streaming, in its sandbox as an unprivileged uid, with a tool-call round trip
driven by the scripted engine; its calls are recorded token-exact with roles and a session."""

from __future__ import annotations

import json
import os
import re
import subprocess
from pathlib import Path

import pytest
from served_proxy import CODEC, ServedProxy

from gyre_ray.agents.harnesses import REPO, build_harness, codex_binary
from gyre_ray.agents.runner import Endpoint, run_execution
from gyre_ray.cells.factories import ScriptedEngineFactory
from gyre_ray.envs.base import Task
from gyre_ray.envs.toy import char_coverage_evaluator
from gyre_ray.proxy.config import ProxySection
from gyre_ray.proxy.responses_schema import ResponsesRequest

CODEX = codex_binary()
PINNED = re.search(r"^CODEX_VERSION \?= (\S+)", (REPO / "Makefile").read_text(), re.MULTILINE).group(1)
pytestmark = pytest.mark.skipif(
    CODEX is None and os.environ.get("CI") != "true",
    reason="Codex is not installed; run: make install-harnesses",
)
IM_END = CODEC.tokenizer.im_end_id
COMMAND = {"cmd": "printf aeiou > answer.txt && echo WROTE_IT"}
TOOL_CALL = '<tool_call>\n{"name": "exec_command", "arguments": ' + json.dumps(COMMAND) + "}\n</tool_call>"


def test_the_pinned_codex_is_installed() -> None:
    assert CODEX is not None, "make install-harnesses must install Codex (CI runs its tests)"
    shown = subprocess.run([CODEX, "--version"], capture_output=True, text=True, timeout=60).stdout
    assert PINNED in shown


def test_codex_exec_completes_an_execution_with_a_tool_call_round_trip(exec_tmp: Path) -> None:
    replies = [
        (CODEC.encode("CODEX_TASK"), CODEC.encode("Writing it.\n" + TOOL_CALL) + [IM_END]),
        (CODEC.encode("WROTE_IT"), CODEC.encode("Done: answer.txt holds the vowels.") + [IM_END]),
    ]
    served = ServedProxy(
        ScriptedEngineFactory({"replies": replies, "reply_length": 8}), exec_tmp, ProxySection()
    )
    try:
        created = served.proxy.register_execution()
        workspace = exec_tmp / "workspaces" / created["execution_id"]
        # a prompt that starts with "-" (a markdown list) is no option: `codex exec` refused it before
        task = Task(
            "vowels", "-\nCODEX_TASK: write the vowels to answer.txt", char_coverage_evaluator("aeiou")
        )
        spec = build_harness(
            "codex", task.prompt, base_url=served.base_url, workspace=workspace,
            home=workspace.parent / f"{workspace.name}.home", as_root=False,
        )  # fmt: skip
        out = run_execution(
            created["execution_id"], task, Endpoint(served.base_url, created["api_key"]), workspace,
            command=spec.command, timeout_s=180, env_extra=spec.env, home_files=spec.home_files,
            require_calls=True,
        )  # fmt: skip
        records = served.proxy.store.records(created["execution_id"])
    finally:
        served.close()
    assert out.exit_code == 0 and out.valid and out.reward == 1.0, out.log_tail
    assert "Done: answer.txt holds the vowels." in out.log_tail
    assert out.calls == len(records) == 2 and [r.role for r in records] == ["main", "main"]
    first, second = records
    bodies = served.bodies
    assert all(b["stream"] for b in bodies) and served.headers[0]["accept"] == "text/event-stream"
    # token-exact: the first prompt is the rendering of what Codex sent; the second splices the first
    # call's recorded output (text + function call) and appends the tool's result
    assert first.input_ids == CODEC.prompt_ids(ResponsesRequest.model_validate(bodies[0]).to_prompt())
    assert (
        second.input_ids[: len(first.input_ids) + len(first.output_ids)] == first.input_ids + first.output_ids
    )
    assert second.parent_call_id == first.call_id
    outputs = [i for i in bodies[1]["input"] if i.get("type") == "function_call_output"]
    assert outputs and "WROTE_IT" in json.dumps(outputs)
    assert first.session == second.session == served.headers[0]["session-id"]
    assert (workspace / "answer.txt").read_text() == "aeiou"
