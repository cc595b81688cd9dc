"""Input the job would only trip over after Ray has started is refused when the config or task file is
loaded, with the field, the bad value and what is allowed named: a task id the record store would
refuse as part of an execution id, and a placeholder in `agents.command` or a task's
`evaluator.command` that formatting would fail on (KeyError) or abuse (attribute/index access)."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest
from pydantic import ValidationError

from gyre_ray.agents.config import AgentSection
from gyre_ray.agents.harnesses import COMMAND_PLACEHOLDERS, build_harness, command_values
from gyre_ray.agents.launch import plan_step
from gyre_ray.cli import main
from gyre_ray.envs.taskfile import (
    EVAL_PLACEHOLDERS,
    TASK_ID_MAX,
    TaskFileError,
    load_task_file,
    parse_task,
)
from gyre_ray.evaluation import plan_round
from gyre_ray.proxy.store import EXECUTION_ID

BAD_PLACEHOLDERS = [
    ("{bogus}", "{bogus}"),
    ("x={prompt.__class__.__mro__}", "{prompt.__class__.__mro__}"),
    ("{workspace[0]}", "{workspace[0]}"),
    ("{workspace!r}", "{workspace!r}"),
    ("{workspace:>99}", "{workspace:>99}"),
    ("{}", "{}"),
    ("{0}", "{0}"),
]
UNBALANCED = ["{workspace", "a } b", "{"]


def _task(task_id, command=None) -> dict:
    return {"id": task_id, "prompt": "p", "evaluator": {"score": "exit-code", "command": command or ["true"]}}


# --- task ids ---------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "task_id", ["hello world", "a/b", "tab\there", "line\n", "café", "x;rm", "x" * (TASK_ID_MAX + 1)]
)
def test_a_task_id_the_record_store_would_refuse_is_refused_when_the_file_is_loaded(
    tmp_path: Path, task_id: str
) -> None:
    path = tmp_path / "tasks.jsonl"
    path.write_text(json.dumps(_task(task_id)) + "\n")
    with pytest.raises(TaskFileError) as refused:
        load_task_file(path)
    message = str(refused.value)
    assert message.startswith("tasks.jsonl:1: id ")
    assert "A-Za-z0-9_.-" in message and f"at most {TASK_ID_MAX} characters" in message
    with pytest.raises(ValidationError, match="A-Za-z0-9_"):  # `gyre-ray config` says it before Ray starts
        AgentSection(task_set=str(path))


@pytest.mark.parametrize("task_id", [None, "", 5, ["a"]])
def test_a_missing_or_non_text_id_is_refused(task_id) -> None:
    with pytest.raises(TaskFileError, match="id must be a non-empty string"):
        parse_task(_task(task_id), Path("."), "t.jsonl:1")


def test_the_longest_allowed_id_still_makes_execution_ids_the_store_takes(tmp_path: Path) -> None:
    longest = "A-z_0.9" * (TASK_ID_MAX // 7) + "x" * (TASK_ID_MAX % 7)
    assert len(longest) == TASK_ID_MAX == 96
    for task_id in (longest, "..", "-x", "a.b_c-1"):
        task = parse_task(_task(task_id), tmp_path, "t")
        step = 10**11  # far beyond any run
        ids = [p.execution_id for p in plan_step(step, [task], 1, 2)]
        ids += [p.group for p in plan_step(step, [task], 1, 1)]
        ids += [item.execution_id for item in plan_round([task], 2, step, tmp_path)]
        ids += [f"s{step}-{task_id}-{10**11}"]
        assert all(EXECUTION_ID.fullmatch(i) for i in ids), ids


# --- evaluator.command placeholders ------------------------------------------------------------------


@pytest.mark.parametrize("item, shown", BAD_PLACEHOLDERS)
def test_an_unknown_or_non_bare_evaluator_placeholder_is_refused(
    tmp_path: Path, item: str, shown: str
) -> None:
    path = tmp_path / "tasks.jsonl"
    path.write_text(json.dumps(_task("t", ["{python}", item])) + "\n")
    with pytest.raises(TaskFileError) as refused:
        load_task_file(path)
    message = str(refused.value)
    assert message.startswith("tasks.jsonl:1 (t): evaluator.command item 1 ")
    assert f"placeholder {shown} is not allowed" in message
    assert all("{" + name + "}" in message for name in EVAL_PLACEHOLDERS)


@pytest.mark.parametrize("item", UNBALANCED)
def test_a_lone_brace_in_an_evaluator_command_is_refused(item: str) -> None:
    with pytest.raises(TaskFileError, match=r"evaluator.command item 0 .*literal brace doubled"):
        parse_task(_task("t", [item]), Path("."), "t.jsonl:1")


def test_every_allowed_evaluator_placeholder_and_literal_braces_format(tmp_path: Path) -> None:
    command = ["{python}", "-c", "print({{'score': 1}})", *("{" + name + "}" for name in EVAL_PLACEHOLDERS)]
    task = parse_task(_task("t", command), tmp_path, "t")
    ws, scratch = tmp_path / "ws", tmp_path / "scratch"
    argv = task.evaluate._command(ws, scratch)
    assert argv[:3] == [sys.executable, "-c", "print({'score': 1})"]
    assert argv[3:] == [
        str(ws),
        str(scratch / "hidden"),
        str(scratch),
        str(scratch / "report.xml"),
        sys.executable,
    ]


# --- agents.command placeholders ---------------------------------------------------------------------


@pytest.mark.parametrize(
    "item, shown",
    [(i.replace("workspace", "prompt"), s.replace("workspace", "prompt")) for i, s in BAD_PLACEHOLDERS],
)
def test_an_unknown_or_non_bare_agents_command_placeholder_is_refused_by_the_config(
    item: str, shown: str
) -> None:
    with pytest.raises(ValidationError) as refused:
        AgentSection(harness="command", command=["agent", item])
    message = str(refused.value)
    assert "agents.command item 1" in message and f"placeholder {shown} is not allowed" in message
    assert all("{" + name + "}" in message for name in COMMAND_PLACEHOLDERS)
    kw = {"base_url": "http://h:1", "workspace": Path("w"), "home": Path("h"), "as_root": False}
    with pytest.raises(
        ValueError, match="is not allowed"
    ):  # a config that skipped the check: still no format
        build_harness("command", "p", template=["agent", item], **kw)


@pytest.mark.parametrize("item", UNBALANCED)
def test_a_lone_brace_in_agents_command_is_refused(item: str) -> None:
    with pytest.raises(ValidationError, match="literal brace doubled"):
        AgentSection(harness="command", command=[item])


def test_gyre_ray_config_refuses_a_bad_agents_command_in_one_line(capsys: pytest.CaptureFixture) -> None:
    assert main(["config", 'agents.command=[echo,"{bogus}"]']) == 2
    err = capsys.readouterr().err
    assert "agents.command item 1 '{bogus}': placeholder {bogus} is not allowed" in err
    assert "Traceback" not in err


def test_every_allowed_agents_command_placeholder_and_literal_braces_format(tmp_path: Path) -> None:
    values = command_values("do it", tmp_path / "ws", tmp_path / "h", "http://x/v1", "http://x")
    assert tuple(values) == COMMAND_PLACEHOLDERS
    template = ["agent", "{{literal}}", *("{" + name + "}" for name in COMMAND_PLACEHOLDERS)]
    assert AgentSection(harness="command", command=template).command == template
    spec = build_harness(
        "command", "do it", base_url="http://x/", workspace=tmp_path / "ws", home=tmp_path / "h",
        as_root=False, template=template,
    )  # fmt: skip
    assert spec.command == [
        "agent",
        "{literal}",
        "do it",
        str(tmp_path / "ws"),
        str(tmp_path / "h"),
        "http://x/v1",
        "http://x",
    ]
