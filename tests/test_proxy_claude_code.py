"""Claude Code itself (`claude -p`, headless) against the proxy: it runs, exits cleanly, and is recorded.

Needs the npm package, installed into the repo's ignored cache folder by `make install-harnesses`
(the version pinned in the Makefile), or CLAUDE_CODE_BIN pointing at a `claude` executable; the tests
skip with that hint otherwise, and fail under CI=true.
The proxy runs in this process under uvicorn (the same app the Serve deployment serves). One test
uses the tiny model; others script the model so that Claude Code spawns a sub-agent, or continue a
session and `/compact` it, proving the role rules and the token-exact splicing on the requests
Claude Code really sends.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
from pathlib import Path

import pytest
from served_proxy import CODEC, ServedProxy

from gyre_ray.cells.factories import PolicyEngineFactory, ScriptedEngineFactory
from gyre_ray.proxy.anthropic_schema import MessagesRequest
from gyre_ray.proxy.config import ProxySection

REPO = Path(__file__).resolve().parents[1]
INSTALL_HINT = "make install-harnesses"


def find_claude() -> str | None:
    candidates = [os.environ.get("CLAUDE_CODE_BIN"), str(REPO / ".cache/claude/node_modules/.bin/claude")]
    for path in candidates:
        if path and os.path.isfile(path) and os.access(path, os.X_OK):
            return path
    return shutil.which("claude") if os.environ.get("GYRE_USE_PATH_CLAUDE") else None


CLAUDE = find_claude()
# Under CI (make test on a fresh machine installs it) a missing Claude Code fails instead of skipping.
pytestmark = pytest.mark.skipif(
    CLAUDE is None and os.environ.get("CI") != "true",
    reason=f"Claude Code is not installed; run: {INSTALL_HINT}",
)


def run_claude(port: int, api_key: str, prompt: str, tmp_path: Path, *args: str, timeout: float = 300):
    home, work = tmp_path / "home", tmp_path / "work"
    home.mkdir(exist_ok=True)
    work.mkdir(exist_ok=True)
    env = {
        "PATH": os.environ.get("PATH", "/usr/bin:/bin"),
        "HOME": str(home),
        "ANTHROPIC_BASE_URL": f"http://127.0.0.1:{port}",
        "ANTHROPIC_API_KEY": api_key,
        "DISABLE_TELEMETRY": "1",
        "CLAUDE_CODE_DISABLE_NONESSENTIAL_TRAFFIC": "1",
    }
    command = [CLAUDE, "-p", prompt, "--output-format", "json", *args]  # args: extra flags
    return subprocess.run(command, env=env, cwd=work, capture_output=True, text=True, timeout=timeout)


@pytest.mark.slow
def test_claude_code_headless_session_on_the_tiny_model(tmp_path):
    served = ServedProxy(PolicyEngineFactory(), tmp_path, ProxySection(max_output_tokens=24))
    try:
        created = served.proxy.register_execution()
        done = run_claude(served.port, created["api_key"], "say hi", tmp_path)
    finally:
        served.close()
    assert done.returncode == 0, done.stdout[-2000:] + done.stderr[-2000:]
    result = json.loads(done.stdout)
    records = served.proxy.store.records(created["execution_id"])
    assert len(records) == len(served.bodies) >= 1
    record, body = records[0], served.bodies[0]
    assert record.role == "main" and record.session and record.session in body["metadata"]["user_id"]
    # exact tokens: the recorded prompt is the rendering of what Claude Code sent, the output what it got
    assert record.input_ids == CODEC.prompt_ids(MessagesRequest.model_validate(body).to_prompt())
    shown = CODEC.decode([t for t in record.output_ids if t not in CODEC.stop_ids])
    assert result["result"].strip() == shown.strip()
    assert len(record.output_ids) == len(record.output_logprobs) <= 24


def test_claude_code_subagent_calls_are_classified_and_spliced(tmp_path):
    im_end = CODEC.tokenizer.im_end_id
    agent_call = (
        '<tool_call>\n{"name": "Agent", "arguments": {"description": "sub task", '
        '"prompt": "Reply with DONE_SUB", "subagent_type": "claude"}}\n</tool_call>'
    )
    replies = [
        (CODEC.encode("SPAWN_SUB"), CODEC.encode("Spawning.\n" + agent_call) + [im_end]),
        (CODEC.encode(" DONE_SUB"), CODEC.encode("done.") + [im_end]),
    ]
    factory = ScriptedEngineFactory({"replies": replies, "reply_length": 8})
    served = ServedProxy(factory, tmp_path, ProxySection(max_output_tokens=80))
    try:
        created = served.proxy.register_execution()
        done = run_claude(
            served.port, created["api_key"], "SPAWN_SUB now", tmp_path, "--allowedTools", "Agent"
        )
    finally:
        served.close()
    assert done.returncode == 0, done.stdout[-2000:] + done.stderr[-2000:]
    assert json.loads(done.stdout)["result"].strip() == "done."
    records = served.proxy.store.records(created["execution_id"])
    assert [r.role for r in records] == ["main", "sub-agent", "main"]
    first, sub, last = records
    assert (
        last.input_ids[: len(first.input_ids) + len(first.output_ids)] == first.input_ids + first.output_ids
    )
    assert last.parent_call_id == first.call_id
    assert len({r.session for r in records}) == 1 and first.session


def test_claude_code_compaction_is_recorded_as_main_summary(tmp_path):
    served = ServedProxy(
        ScriptedEngineFactory({"reply_length": 8}), tmp_path, ProxySection(max_output_tokens=40)
    )
    try:
        created = served.proxy.register_execution()
        turns = [
            ("first turn",),
            ("--continue", "second turn"),
            ("--continue", "third turn"),
            ("--continue", "/compact"),
        ]
        for turn in turns:
            done = run_claude(served.port, created["api_key"], turn[-1], tmp_path, *turn[:-1])
            assert done.returncode == 0, done.stdout[-2000:] + done.stderr[-2000:]
    finally:
        served.close()
    roles = [r.role for r in served.proxy.store.records(created["execution_id"])]
    assert roles == ["main", "main", "main", "main-summary"]
