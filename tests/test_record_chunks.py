"""Records files in the chunked form: a shared prompt prefix written once per file, records read back whole."""

from __future__ import annotations

import random

import pytest

from gyre_ray.proxy import store_files
from gyre_ray.proxy.store import TrajectoryStore
from gyre_ray.trajectory.record_chunks import CHUNK_TOKENS
from gyre_ray.trajectory.records import CallRecord, RecordError, read_jsonl


def _conversation(execution_id: str, calls: int, seed: int = 0) -> list[CallRecord]:
    """A main agent whose prompt grows by its output and a tool result every call, with a compaction
    (a new context: the system prompt and a summary) halfway and a sub-agent of its own prompt."""
    rng = random.Random(seed)
    system = [rng.randrange(50_000) for _ in range(3 * CHUNK_TOKENS + 17)]
    context, records = list(system), []
    for i in range(calls):
        if i == calls // 2:
            context = system + [rng.randrange(50_000) for _ in range(300)]  # compaction
        prompt = list(context) if i % 5 != 3 else [7] * (CHUNK_TOKENS + 5)  # a sub-agent's call
        output = [rng.randrange(50_000) for _ in range(rng.randrange(0, 400))]
        records.append(
            CallRecord(
                execution_id,
                f"call-{i}",
                "main",
                prompt,
                output,
                [-0.5] * len(output),
                [i] * len(output),
                float(i),
                float(i) + 0.5,
                meta={"i": i},
            )  # fmt: skip
        )
        if i % 5 != 3:
            context = prompt + output + [rng.randrange(50_000) for _ in range(rng.randrange(1, 900))]
    return records


@pytest.mark.parametrize("durable", [True, False])
def test_records_come_back_whole_and_shared_prefixes_are_written_once(tmp_path, durable: bool) -> None:
    records = _conversation("exec-a", 24)
    store = TrajectoryStore(tmp_path, max_records_in_memory=5, durable=durable, fsync=False)
    store.register("exec-a")
    for start in range(0, len(records), 3):  # batches, as replicas hand them over
        store.add_many([(r, None) for r in records[start : start + 3]])
    store.finish_execution("exec-a")
    path = tmp_path / "exec-a.jsonl"
    assert [r.to_json() for r in read_jsonl(path)] == [r.to_json() for r in records]
    assert [r.to_json() for r in store.records("exec-a")] == [r.to_json() for r in records]
    lines = path.read_bytes().splitlines()
    chunk_lines = [line for line in lines if line.startswith(b'{"chunk":')]
    assert len(lines) - len(chunk_lines) == len(records) == store_files.count_records(path)
    plain = sum(len(r.to_json()) + 1 for r in records)
    assert path.stat().st_size < plain / 3  # the prompts repeat each other; written once, they do not
    names = [line[10:34] for line in chunk_lines]
    assert len(names) == len(set(names))  # every chunk once per file


def test_a_restarted_store_knows_which_chunks_its_files_hold(tmp_path) -> None:
    records = _conversation("exec-a", 10, seed=3)
    store = TrajectoryStore(tmp_path, durable=True, fsync=False)
    store.register("exec-a")
    store.add_many([(r, None) for r in records[:6]])
    path = tmp_path / "exec-a.jsonl"
    with open(path, "ab") as fh:  # the store killed mid-write: a torn record line after its chunks
        fh.write(b'{"input_chunks": ["00"], "execution_id": "exec-a", "call_id": "call-6", "ro')
    again = TrajectoryStore(tmp_path, durable=True, fsync=False, restore=True)
    before = path.read_bytes().count(b'{"chunk":')
    again.add_many([(r, None) for r in records[6:]])
    assert path.read_bytes().count(b'{"chunk":') == before + sum(  # only chunks it had not written
        1 for line in _lines_of(records, 6) if line.startswith('{"chunk":')
    )
    assert [r.to_json() for r in again.records("exec-a")] == [r.to_json() for r in records]


def _lines_of(records: list[CallRecord], start: int) -> list[str]:
    """The lines records[start:] add to a file that holds records[:start]."""
    written: set[str] = set()
    for r in records[:start]:
        r.to_file_lines(written)
    return [line for r in records[start:] for line in r.to_file_lines(written)]


def test_a_record_naming_a_chunk_the_file_lacks_is_refused_with_its_line(tmp_path) -> None:
    (record,) = _conversation("exec-a", 1)
    written: set[str] = set()
    lines = record.to_file_lines(written)
    path = tmp_path / "exec-a.jsonl"
    path.write_text(lines[-1])  # the record without its chunk lines
    with pytest.raises(
        RecordError, match=r"exec-a.jsonl:1: input_chunks names chunk \w+ that no earlier line"
    ):
        read_jsonl(path)
    path.write_text('{"chunk": "ab", "ids": [1, 2]}\n')
    with pytest.raises(
        RecordError, match=f"exec-a.jsonl:1: a chunk line needs a name and {CHUNK_TOKENS} ids"
    ):
        read_jsonl(path)


def test_short_prompts_stay_in_the_plain_form(tmp_path) -> None:
    record = CallRecord("e", "c", "main", [1] * (CHUNK_TOKENS - 1), [2], [-0.1], [0], 0.0, 1.0)
    assert record.to_file_lines(set()) == [record.to_json() + "\n"]
