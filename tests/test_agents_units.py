"""Small pieces of the agent runtime: outcome metrics, Codex role headers, harness command lines,
the agents config, and an execution without records left out of training instead of crashing it."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from pydantic import ValidationError

from gyre_ray.agents.config import AgentSection
from gyre_ray.agents.harnesses import build_harness, codex_config
from gyre_ray.agents.outcomes import outcome_metrics
from gyre_ray.agents.runner import ExecutionOutcome
from gyre_ray.proxy.roles import codex_role
from gyre_ray.trajectory.pipeline import training_batches_with_stats


def _outcome(eid: str, valid: bool, reason: str = "", detail: str = "") -> ExecutionOutcome:
    return ExecutionOutcome(eid, "t", 0, False, 1.0, 0.5 if valid else 0.0, valid, detail, "", reason)


def test_outcome_metrics_count_drops_and_name_every_reason() -> None:
    outcomes = [
        _outcome("a", True),
        _outcome("b", False, "no model calls"),
        _outcome("c", False, "evaluator timed out (after 3 evaluator tries)"),
        _outcome("d", True, "timed out; killed at its disk limit (64 MiB)"),
        _outcome("e", False, "", detail="evaluator failed: KeyError"),
    ]
    metrics = outcome_metrics(outcomes)
    assert metrics["dropped"] == 3
    assert metrics["drop_reasons"] == {
        "no model calls": 1,
        "evaluator timed out (after 3 evaluator tries)": 1,
        "evaluator failed": 1,
    }
    assert metrics["scored_with_issues"] == {"timed out": 1}
    assert set(metrics["execution_reasons"]) == {"b", "c", "d", "e"}


def _meta(**fields) -> dict[str, str]:
    return {"x-codex-turn-metadata": json.dumps(fields)}


@pytest.mark.parametrize(
    "headers, role",
    [
        (_meta(agent_name="/root", request_kind="turn"), None),
        (_meta(agent_name="/root", request_kind="compact"), "main-summary"),
        (_meta(agent_name="/root/worker-1", request_kind="turn"), "sub-agent"),
        (_meta(agent_name="explorer", request_kind="remote_compaction"), "sub-agent-summary"),
        ({"x-codex-turn-metadata": "not json"}, None),
        ({}, None),
    ],
)
def test_codex_turn_metadata_names_summaries_and_sub_agents(headers: dict, role: str | None) -> None:
    assert codex_role(headers) == role


def test_the_prompt_follows_a_double_dash_and_a_root_harness_gets_is_sandbox(
    tmp_path: Path, monkeypatch
) -> None:
    """A prompt starting with "-" stopped both CLIs at argument parsing (every execution dropped);
    `agents.command` starting Claude Code as root lacked IS_SANDBOX, which it needs there."""
    monkeypatch.setenv("CLAUDE_CODE_BIN", "/bin/true")
    monkeypatch.setenv("CODEX_BIN", "/bin/true")
    kw = {"base_url": "http://127.0.0.1:7/", "workspace": tmp_path / "ws", "home": tmp_path / "h"}
    for harness in ("claude-code", "codex"):
        spec = build_harness(harness, "- build it", as_root=False, extra_args=["--tools", "Write"], **kw)
        assert spec.command[-2:] == ["--", "- build it"] and spec.command[-4:-2] == ["--tools", "Write"]
    template = ["claude", "-p", "{prompt}", "--dangerously-skip-permissions"]
    assert build_harness("command", "p", template=template, as_root=True, **kw).env == {"IS_SANDBOX": "1"}
    assert build_harness("command", "p", template=template, as_root=False, **kw).env == {}
    assert "request_max_retries = 4" in codex_config("http://x/v1")  # a 429 / 503 is retried


def test_harness_command_lines(tmp_path: Path) -> None:
    kw = {"base_url": "http://127.0.0.1:7/", "workspace": tmp_path / "ws", "home": tmp_path / "h"}
    spec = build_harness(
        "command", "do {it}", template=["agent", "{openai_base_url}", "--task={prompt}"], as_root=False, **kw
    )
    assert spec.command == ["agent", "http://127.0.0.1:7/v1", "--task=do {it}"]
    with pytest.raises(ValueError, match="needs agents.command"):
        build_harness("command", "x", as_root=False, **kw)
    assert 'base_url = "http://127.0.0.1:7/v1"' in codex_config("http://127.0.0.1:7/v1")
    assert 'wire_api = "responses"' in codex_config(
        "http://x/v1"
    ) and 'env_key = "GYRE_API_KEY"' in codex_config("x")


def test_agents_config_checks_task_files_and_harness_names(tmp_path: Path) -> None:
    assert AgentSection(task_set="nl2repo-mini").task_set == "nl2repo-mini"
    with pytest.raises(ValidationError, match="does not exist"):
        AgentSection(task_set=str(tmp_path / "missing.yaml"))
    with pytest.raises(ValidationError, match="must be one of"):
        AgentSection(task_set="imagenet")
    with pytest.raises(ValidationError):
        AgentSection(harness="aider")


def test_an_execution_without_records_is_left_out_of_training() -> None:
    batches, stats = training_batches_with_stats({"quiet": []}, {"quiet": 0.0}, {"quiet": "g"})
    assert batches == [] and stats == []


def test_the_disk_watch_counts_a_file_linked_many_times_once(tmp_path: Path) -> None:
    from gyre_ray.agents.sandbox import disk_mb

    (tmp_path / "big").write_bytes(b"x" * (4 << 20))
    for n in range(10):  # links cost no space: an agent must not be cut off at its disk limit for them
        (tmp_path / f"link-{n}").hardlink_to(tmp_path / "big")
    (tmp_path / "sub").mkdir()
    (tmp_path / "sub" / "own").write_bytes(b"y" * (1 << 20))
    assert 5.0 <= disk_mb([tmp_path]) < 5.5
