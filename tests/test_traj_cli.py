"""`gyre-ray traj show`: the tree with roles, token counts and selected paths; `--json` token figures."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from gyre_ray.cli import main
from gyre_ray.trajectory.pipeline import process_execution
from gyre_ray.trajectory.records import write_jsonl
from gyre_ray.trajectory.synthetic import SyntheticWorkload, synthetic_execution

WORKLOAD = SyntheticWorkload(system_tokens=16, task_tokens=4, subagent_system_tokens=8, segments=(2, 2),
                             max_subagents=6, unknown_roles=True)  # fmt: skip
REQUIRED = ("paths_total", "paths_selected", "tokens_expanded_all", "tokens_packed_all",
            "tokens_expanded_selected", "tokens_packed_selected", "loss_tokens_selected")  # fmt: skip


@pytest.fixture
def records_file(tmp_path: Path) -> tuple[Path, dict]:
    records = {e: synthetic_execution(e, seed, WORKLOAD)[0] for e, seed in (("a", 4), ("b", 5))}
    path = tmp_path / "records.jsonl"
    write_jsonl(path, [r for rs in records.values() for r in rs])
    return path, records


def test_json_has_the_token_figures_per_execution_and_in_total(records_file, capsys) -> None:
    path, records = records_file
    assert main(["traj", "show", str(path), "--json", "--budget", "2"]) == 0
    out = json.loads(capsys.readouterr().out)
    for key in REQUIRED:
        assert out[key] == sum(e[key] for e in out["executions"])
    for e in out["executions"]:
        expected = process_execution(records[e["execution_id"]]).stats()
        assert e["paths_total"] == expected["paths_total"] > 2
        assert e["paths_selected"] == 2 and sum(p["selected"] for p in e["paths"]) == 2
        assert e["tokens_expanded_all"] == expected["tokens_expanded_all"] > e["tokens_packed_all"]
        assert e["tokens_packed_selected"] <= e["tokens_expanded_selected"]
        assert e["paths"][0]["role"] and set(e["call_roles"]) <= {
            "main",
            "main-summary",
            "sub-agent",
            "sub-agent-summary",
        }


def test_text_view_shows_roles_counts_and_selection(records_file, capsys) -> None:
    path, records = records_file
    assert main(["traj", "show", str(path), "--execution", "a", "--budget", "3"]) == 0
    text = capsys.readouterr().out
    proc = process_execution(records["a"])
    assert text.startswith(f"execution a: {len(records['a'])} calls")
    assert f"3 of {len(proc.paths)} paths selected (budget 3)" in text
    assert text.count("[selected #") == 3 and text.count("[dropped]") == len(proc.paths) - 3
    assert "(main)" in text and "(sub-agent)" in text and "main-summary" in text
    assert f"{proc.tree.num_tokens}" in text and " loss" in text


def test_bad_input_exits_2_with_a_reason(tmp_path: Path, records_file, capsys) -> None:
    bad = tmp_path / "bad.jsonl"
    bad.write_text('{"execution_id": "x"}\n')
    assert main(["traj", "show", str(bad)]) == 2
    assert "bad.jsonl:1: call record is missing field(s)" in capsys.readouterr().err
    assert main(["traj", "show", str(tmp_path / "missing.jsonl")]) == 2
    assert "cannot read" in capsys.readouterr().err
    path, _ = records_file
    assert main(["traj", "show", str(path), "--execution", "zzz"]) == 2
    assert "no execution 'zzz' (have: a, b)" in capsys.readouterr().err
    assert main(["traj", "show", str(path), "--budget", "0"]) == 2
    assert "--budget must be an integer >= 1" in capsys.readouterr().err
    assert main(["traj", "show", str(path), "--vocab-size", "100"]) == 2
    assert "outside the vocabulary (vocab_size 100)" in capsys.readouterr().err


@pytest.mark.parametrize(
    ("content", "message"),
    [
        (b"", "holds no call records"),
        (b"\xd0\xcf\x11\xe0 not text\n", "f.jsonl:1: not UTF-8 text"),
        (None, "execution 'a': duplicate call_id 'c0'"),
    ],
)
def test_unreadable_empty_or_contradictory_files_exit_2_in_one_line(
    tmp_path: Path, capsys, content: bytes | None, message: str
) -> None:
    path = tmp_path / "f.jsonl"
    if content is None:  # each line is a valid record, but two share a call id
        record = synthetic_execution("a", 1, WORKLOAD)[0][0]
        write_jsonl(path, [record, record])
    else:
        path.write_bytes(content)
    assert main(["traj", "show", str(path)]) == 2
    err = capsys.readouterr().err
    assert message in err and len(err.strip().splitlines()) == 1


@pytest.fixture
def records_folder(tmp_path: Path, records_file) -> Path:
    """A run's records/: one <execution_id>.jsonl per execution, beside the store's own files."""
    _, records = records_file
    folder = tmp_path / "records"
    (folder / ".splice").mkdir(parents=True)
    for execution_id, rs in records.items():
        write_jsonl(folder / f"{execution_id}.jsonl", rs)
    (folder / ".registry.jsonl").write_text('{"finish": "a"}\n')  # not a call record
    return folder


def test_a_records_folder_lists_its_executions(records_folder: Path, records_file, capsys) -> None:
    _, records = records_file
    assert main(["traj", "show", str(records_folder)]) == 0
    lines = capsys.readouterr().out.splitlines()
    assert lines[0] == f"{records_folder}: 2 executions; show one with --execution ID"
    assert lines[1].split() == ["execution", "calls", "tokens"] and len(lines) == 4
    for line, (execution_id, rs) in zip(lines[2:], sorted(records.items()), strict=True):
        tokens = sum(len(r.input_ids) + len(r.output_ids) for r in rs)
        assert line.split() == [execution_id, str(len(rs)), str(tokens)]


def test_a_records_folder_shows_one_execution_or_all_figures(
    records_folder: Path, records_file, capsys
) -> None:
    path, _ = records_file
    for source in (path, records_folder):  # the folder shows what the file of all records shows
        assert main(["traj", "show", str(source), "--execution", "b", "--budget", "2"]) == 0
        assert main(["traj", "show", str(source), "--json"]) == 0
    from_file, from_folder = capsys.readouterr().out.split("execution b:")[1:]
    assert from_file == from_folder and from_folder.count('"execution_id"') == 2
    assert main(["traj", "show", str(records_folder), "--execution", "zzz"]) == 2
    err = capsys.readouterr().err
    assert f"no execution 'zzz' in {records_folder} (2 record files;" in err
    (records_folder / "a.jsonl").unlink()
    (records_folder / "b.jsonl").unlink()
    assert main(["traj", "show", str(records_folder)]) == 2
    assert "holds no record files" in capsys.readouterr().err
