"""Call records: JSONL round trip, and self-contradicting records rejected with a reason naming the field."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from gyre_ray.trajectory.records import (
    ROLES,
    CallRecord,
    RecordError,
    group_by_execution,
    read_jsonl,
    validate_execution,
    write_jsonl,
)


def record(**overrides) -> CallRecord:
    base = dict(
        execution_id="e1",
        call_id="c1",
        role="main",
        input_ids=[5, 6, 7],
        output_ids=[8, 9],
        output_logprobs=[-0.5, -1.25],
        versions=[3, 4],
        t_start=1.0,
        t_end=2.5,
    )
    base.update(overrides)
    return CallRecord(**base)


def test_roles_are_the_issue_roles() -> None:
    assert ROLES == ("main", "main-summary", "sub-agent", "sub-agent-summary", "unknown")


def test_json_line_round_trip_keeps_every_field(tmp_path: Path) -> None:
    a = record(parent_call_id="c0", session="s", meta={"finish": "stop"})
    b = record(call_id="c2", role="unknown", output_ids=[], output_logprobs=[], versions=[])
    line = a.to_json()
    assert "\n" not in line
    assert set(json.loads(line)) >= {
        "execution_id", "call_id", "role", "input_ids", "output_ids",
        "output_logprobs", "versions", "t_start", "t_end",
    }  # fmt: skip
    assert CallRecord.from_json(line) == a
    path = tmp_path / "records.jsonl"
    assert write_jsonl(path, [a, b]) == 2
    assert read_jsonl(path, vocab_size=10) == [a, b]


def test_optional_fields_may_be_absent_on_disk() -> None:
    data = json.loads(record().to_json())
    for key in ("parent_call_id", "session", "meta"):
        data.pop(key)
    parsed = CallRecord.from_json(json.dumps(data))
    assert parsed.meta == {} and parsed.parent_call_id is None


@pytest.mark.parametrize(
    ("overrides", "vocab", "reason"),
    [
        ({"output_logprobs": [-0.5]}, None, "output_logprobs has 1 entries but output_ids has 2"),
        ({"versions": [1, 2, 3]}, None, "versions has 3 entries but output_ids has 2"),
        ({"output_ids": [8, 10]}, 10, r"output_ids\[1\] = 10 is outside the vocabulary \(vocab_size 10\)"),
        ({"input_ids": [5, 99]}, 50, r"input_ids\[1\] = 99 is outside the vocabulary"),
        ({"input_ids": [5, -1]}, None, r"input_ids\[1\] = -1 is not a token id"),
        ({"input_ids": [5, True]}, None, r"input_ids\[1\] = True is not a token id"),
        ({"input_ids": []}, None, "input_ids must be a non-empty list"),
        ({"output_logprobs": [-0.5, 0.3]}, None, r"output_logprobs\[1\] = 0.3 is a log-probability above 0"),
        ({"output_logprobs": [-0.5, float("nan")]}, None, "not a finite number"),
        ({"versions": [1, -2]}, None, r"versions\[1\] = -2 must be an integer >= 0"),
        ({"role": "planner"}, None, "role 'planner' is not one of main, main-summary"),
        ({"t_end": 0.5}, None, "t_end 0.5 is before t_start 1.0"),
        ({"call_id": ""}, None, "call_id must be a non-empty string"),
        # past float range, or past 32 bits: a clear reason, not an OverflowError
        (
            {"output_logprobs": [-0.5, -(10**400)]},
            None,
            r"output_logprobs\[1\] = -1000.* is not a finite number",
        ),
        ({"t_end": 10**400}, None, r"t_end = 1000.* is not a finite number of seconds"),
        ({"input_ids": [5, 2**32]}, None, r"input_ids\[1\] = 4294967296 is beyond any vocabulary"),
    ],
)
def test_self_contradicting_record_is_rejected_with_its_reason(overrides, vocab, reason) -> None:
    with pytest.raises(RecordError, match=reason):
        record(**overrides).validate(vocab)


def test_valid_record_passes_validation_with_vocab_limit() -> None:
    assert record().validate(vocab_size=10).call_id == "c1"


def test_missing_and_unknown_fields_are_named() -> None:
    data = json.loads(record().to_json())
    del data["versions"]
    with pytest.raises(RecordError, match="missing field\\(s\\): versions"):
        CallRecord.from_dict(data)
    data = json.loads(record().to_json())
    data["tokens"] = [1]
    with pytest.raises(RecordError, match="unknown field\\(s\\) tokens; put extra data under 'meta'"):
        CallRecord.from_dict(data)
    with pytest.raises(RecordError, match="not valid JSON"):
        CallRecord.from_json("{not json")


def test_bad_line_is_reported_with_file_and_line_number(tmp_path: Path) -> None:
    path = tmp_path / "r.jsonl"
    bad = json.loads(record(call_id="c2").to_json())
    bad["output_logprobs"] = [-1.0]
    path.write_text(record().to_json() + "\n\n" + json.dumps(bad) + "\n")
    with pytest.raises(RecordError, match=r"r.jsonl:3: .*'c2'.*output_logprobs has 1 entries"):
        read_jsonl(path)


def test_execution_level_contradictions() -> None:
    with pytest.raises(RecordError, match="duplicate call_id 'c1'"):
        validate_execution([record(), record(t_start=3.0, t_end=4.0)])
    with pytest.raises(RecordError, match="several execution ids"):
        validate_execution([record(), record(execution_id="e2", call_id="c2")])
    grouped = group_by_execution([record(), record(execution_id="e2"), record(call_id="c3")])
    assert {k: [r.call_id for r in v] for k, v in grouped.items()} == {"e1": ["c1", "c3"], "e2": ["c1"]}
