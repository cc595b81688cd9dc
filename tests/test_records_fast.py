"""Call records at scale: `to_json` / `to_dict` without `dataclasses.asdict`'s deep copy, and `validate`
checking whole lists in C, with the same JSON and the same error messages as the item-by-item code."""

from __future__ import annotations

import dataclasses
import enum
import json
import math
from typing import Any

import numpy as np
import pytest

from gyre_ray.trajectory import records as records_module
from gyre_ray.trajectory.records import LOGPROB_TOLERANCE, CallRecord, RecordError


def record(**overrides: Any) -> CallRecord:
    base: dict[str, Any] = dict(
        execution_id="e1",
        call_id="c1",
        role="main",
        input_ids=list(range(5, 2005)),
        output_ids=[8, 9, 10],
        output_logprobs=[-0.5, -1.25, 0.0],
        versions=[3, 4, 4],
        t_start=1.0,
        t_end=2.5,
    )
    base.update(overrides)
    return CallRecord(**base)


@dataclasses.dataclass
class _Nested:
    name: str
    values: tuple[int, ...]


def _asdict_json(r: CallRecord) -> str:
    """What `to_json` wrote before: `json.dumps(dataclasses.asdict(record))`."""
    return json.dumps(dataclasses.asdict(r), separators=(",", ":"))


@pytest.mark.parametrize(
    "overrides",
    [
        {},
        {"parent_call_id": "c0", "session": "s", "meta": {"finish_reason": "stop", "cells": ["cell-0"]}},
        {"output_ids": [], "output_logprobs": [], "versions": [], "role": "unknown"},
        {"meta": {"nested": {"a": [1, 2.5, None, True]}, "tuple": (1, 2), "text": 'é\n"x"'}},
        {"meta": {"dataclass": _Nested("n", (1, 2))}, "t_start": 3, "t_end": 4.000001},
        {"output_logprobs": [-0.0, -1e-300, -123.456789012345678]},
    ],
)
def test_to_json_is_byte_for_byte_what_asdict_gave_and_round_trips(overrides) -> None:
    r = record(**overrides)
    line = r.to_json()
    assert line == _asdict_json(r)
    assert list(r.to_dict()) == [f.name for f in dataclasses.fields(CallRecord)]
    assert json.dumps(r.to_dict(), separators=(",", ":"), default=dataclasses.asdict) == line
    assert CallRecord.from_json(line, vocab_size=2005).to_json() == line


def test_to_json_and_to_dict_do_not_deep_copy_the_token_lists(monkeypatch) -> None:
    """asdict deep-copied every token list: ~90 ms of a 150k-token record's 100 ms, in the store actor."""

    def no_asdict(*_: Any, **__: Any) -> None:
        raise AssertionError("dataclasses.asdict deep-copies every token list")

    monkeypatch.setattr(records_module, "asdict", no_asdict)
    monkeypatch.setattr(dataclasses, "asdict", no_asdict)
    r = record(meta={"model": "m", "cells": ["cell-0"]})
    assert json.loads(r.to_json())["input_ids"] == r.input_ids
    data = r.to_dict()
    assert data["input_ids"] == r.input_ids and data["meta"] == r.meta
    data["input_ids"].append(7)  # the dict's lists and meta are the caller's own
    data["meta"]["model"] = "other"
    assert len(r.input_ids) == 2000 and r.meta["model"] == "m"
    with pytest.raises(TypeError, match="Object of type object is not JSON serializable"):
        record(meta={"x": object()}).to_json()


def _finite(value: float) -> bool:
    try:
        return math.isfinite(value)
    except OverflowError:  # an int past float range: not a finite number either
        return False


def _reference_validate(self: CallRecord, vocab_size: int | None = None) -> None:
    """The item-by-item checks `validate` made before its fast path (the messages must stay these),
    with an id past 32 bits refused without a vocabulary too, and an int logprob past float range
    a RecordError (both raised OverflowError deeper down before 2026-12-07)."""
    where = f"record {self.execution_id!r}/{self.call_id!r}"
    for name in ("input_ids", "output_ids"):
        for i, tok in enumerate(getattr(self, name)):
            if not (isinstance(tok, int) and not isinstance(tok, bool)) or tok < 0:
                raise RecordError(f"{where}: {name}[{i}] = {tok!r} is not a token id (integer >= 0)")
            if vocab_size is not None and tok >= vocab_size:
                raise RecordError(
                    f"{where}: {name}[{i}] = {tok} is outside the vocabulary (vocab_size {vocab_size})"
                )
            if tok > 2**32 - 1:
                raise RecordError(f"{where}: {name}[{i}] = {tok} is beyond any vocabulary (over 2**32 - 1)")
    for i, lp in enumerate(self.output_logprobs):
        if not isinstance(lp, (int, float)) or isinstance(lp, bool) or not _finite(lp):
            raise RecordError(f"{where}: output_logprobs[{i}] = {lp!r} is not a finite number")
        if lp > LOGPROB_TOLERANCE:
            raise RecordError(f"{where}: output_logprobs[{i}] = {lp} is a log-probability above 0")
    for i, version in enumerate(self.versions):
        if not (isinstance(version, int) and not isinstance(version, bool)) or version < 0:
            raise RecordError(f"{where}: versions[{i}] = {version!r} must be an integer >= 0")


class _Tok(enum.IntEnum):
    FIVE = 5


def _outcome(fn, *args) -> tuple[type, str] | None:
    try:
        fn(*args)
    except Exception as exc:  # the type matters too
        return type(exc), str(exc)
    return None


BAD_ITEMS = [-1, True, False, 1.5, 5.0, None, "3", np.int64(5), 10**30, -(10**30), _Tok.FIVE, 600, 599]
BAD_LOGPROBS = [
    0.3,
    1e-3,
    5e-5,
    float("nan"),
    float("inf"),
    -math.inf,
    True,
    "x",
    None,
    10**400,
    -(10**400),
    1,
    -2,
]


@pytest.mark.parametrize("vocab", [None, 600])
@pytest.mark.parametrize("field", ["input_ids", "output_ids", "versions"])
@pytest.mark.parametrize("position", [0, 1, -1])
@pytest.mark.parametrize("bad", BAD_ITEMS, ids=repr)
def test_validate_reports_the_first_bad_id_exactly_as_before(vocab, field, position, bad) -> None:
    n = 1000
    values = [(7 * i) % 500 for i in range(n)]
    values[position] = bad
    values[-3] = -5 if position == 0 else values[-3]  # a second bad item: the first one is named
    overrides: dict[str, Any] = {field: values}
    if field != "input_ids":
        overrides.update({name: [0] * n for name in ("output_ids", "versions") if name != field})
        overrides["output_logprobs"] = [-0.5] * n
    r = record(**overrides)
    expected = _outcome(_reference_validate, r, vocab)
    assert _outcome(r.validate, vocab) == expected


@pytest.mark.parametrize("position", [0, 1, -1])
@pytest.mark.parametrize("bad", BAD_LOGPROBS, ids=repr)
def test_validate_reports_the_first_bad_logprob_exactly_as_before(position, bad) -> None:
    n = 500
    logprobs: list[Any] = [-0.001 * i for i in range(n)]
    logprobs[position] = bad
    r = record(output_ids=[1] * n, versions=[0] * n, output_logprobs=logprobs)
    assert _outcome(r.validate, None) == _outcome(_reference_validate, r, None)


def test_finite_logprobs_whose_sum_overflows_are_still_valid() -> None:
    r = record(output_ids=[1, 1], versions=[0, 0], output_logprobs=[-1.5e308, -1.5e308])
    assert r.validate() is r


def test_validate_checks_a_valid_record_without_a_python_loop_per_token(monkeypatch) -> None:
    """Item by item cost ~100 ns a token (3.2 s for a 417-call execution); valid lists are checked in C."""
    looked_at: list[Any] = []
    real = records_module.is_int

    def counting(value: Any) -> bool:
        looked_at.append(value)
        return real(value)

    monkeypatch.setattr(records_module, "is_int", counting)
    n = 20_000
    r = record(input_ids=list(range(n)), output_ids=[3] * n, output_logprobs=[-0.1] * n, versions=[2] * n)
    assert r.validate(vocab_size=n) is r
    assert looked_at == [n]  # only vocab_size itself
    with pytest.raises(RecordError, match=rf"input_ids\[{n - 1}\] = {n - 1} is outside the vocabulary"):
        r.validate(vocab_size=n - 1)
