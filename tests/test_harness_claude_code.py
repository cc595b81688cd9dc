"""Claude Code (the version pinned in the Makefile) as the `claude-code` harness, started as root the
way the job starts it: it runs as an unprivileged uid of its own with its own HOME, writes the task's
package with its Write tool (scripted engine) and the hidden tests give it partial credit."""

from __future__ import annotations

import json
import os
import re
import subprocess
from pathlib import Path

import pytest
from served_proxy import CODEC, ServedProxy

from gyre_ray.agents.config import AgentSection
from gyre_ray.agents.harnesses import REPO, build_harness, claude_binary
from gyre_ray.agents.launch import runs_as_root
from gyre_ray.agents.runner import Endpoint, run_execution
from gyre_ray.cells.factories import ScriptedEngineFactory
from gyre_ray.envs.base import get_task_set
from gyre_ray.proxy.config import ProxySection

CLAUDE = claude_binary()
PINNED = re.search(r"^CLAUDE_CODE_VERSION \?= (\S+)", (REPO / "Makefile").read_text(), re.MULTILINE).group(1)
pytestmark = pytest.mark.skipif(
    CLAUDE is None and os.environ.get("CI") != "true",
    reason="Claude Code is not installed; run: make install-harnesses",
)
IM_END = CODEC.tokenizer.im_end_id
RLE_HALF = (
    "import itertools\n\ndef encode(t):\n    return [(k, len(list(g))) for k, g in itertools.groupby(t)]\n\n"
    'def decode(runs):\n    return ""\n'
)


def test_the_pinned_claude_code_is_installed() -> None:
    assert CLAUDE is not None, "make install-harnesses must install Claude Code (CI runs its tests)"
    shown = subprocess.run([CLAUDE, "--version"], capture_output=True, text=True, timeout=60).stdout
    assert PINNED in shown


def test_claude_code_as_root_runs_unprivileged_and_earns_partial_credit(exec_tmp: Path) -> None:
    assert os.geteuid() != 0 or not runs_as_root(AgentSection())  # root jobs give it a uid of its own
    task = next(t for t in get_task_set("nl2repo-mini") if t.task_id == "rlekit")
    workspace = exec_tmp / "workspaces" / "cc-0"
    write = {"file_path": str(workspace / "rlekit/__init__.py"), "content": RLE_HALF}
    tool_call = '<tool_call>\n{"name": "Write", "arguments": ' + json.dumps(write) + "}\n</tool_call>"
    replies = [
        (CODEC.encode(" run-length encoding"), CODEC.encode("Writing the package.\n" + tool_call) + [IM_END]),
        (CODEC.encode("File created successfully"), CODEC.encode("Package written.") + [IM_END]),
    ]
    served = ServedProxy(
        ScriptedEngineFactory({"replies": replies, "reply_length": 8}), exec_tmp, ProxySection()
    )
    try:
        created = served.proxy.register_execution("cc-0")
        spec = build_harness(  # a prompt that starts with "-" is no option (`claude -p` refused it)
            "claude-code", "- " + task.prompt, base_url=served.base_url, workspace=workspace,
            home=workspace.parent / "cc-0.home", as_root=False, extra_args=["--tools", "Write"],
        )  # fmt: skip
        out = run_execution(
            "cc-0", task, Endpoint(served.base_url, created["api_key"]), workspace, command=spec.command,
            timeout_s=180, env_extra=spec.env, require_calls=True,
        )  # fmt: skip
        records = served.proxy.store.records("cc-0")
    finally:
        served.close()
    assert out.exit_code == 0 and out.valid, out.log_tail
    assert out.reward == 0.5 and out.detail == "2/4 hidden tests passed"
    assert "Package written." in out.log_tail
    assert out.calls == len(records) == 2 and [r.role for r in records] == ["main", "main"]
    assert records[1].parent_call_id == records[0].call_id
    owner = (workspace / "rlekit/__init__.py").stat()
    assert owner.st_uid == os.geteuid()  # handed back to the job after the execution
    home = workspace.parent / "cc-0.home"
    assert (home / ".claude.json").exists() or (home / ".claude").is_dir()  # its state: its own HOME
