"""Group processing reads a finished execution's records from the file the store wrote when it sees
it whole, and through the store actor otherwise (another node, a stale or foreign file)."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest

from gyre_ray.proxy.store import create_store_actor
from gyre_ray.runtime.groups import finished_records, read_complete_file
from gyre_ray.trajectory.records import CallRecord, write_jsonl
from tests.local_ray import private_ray


@pytest.fixture(scope="module")
def ray_up() -> Iterator[None]:
    with private_ray():
        yield


def call(execution_id: str, i: int, prompt: int = 3000) -> CallRecord:
    """A call whose prompt grows with i (shared prefixes, like an agent's turns)."""
    return CallRecord(
        execution_id=execution_id,
        call_id=f"call-{i:06d}",
        role="main",
        input_ids=[(7 * j) % 900 + 5 for j in range(prompt + 40 * i)],
        output_ids=[11, 12, 13 + i % 5],
        output_logprobs=[-0.5, -0.25, -1.0],
        versions=[0, 0, 0],
        t_start=float(i),
        t_end=i + 0.5,
    )


def test_finished_records_come_from_the_store_file_or_else_from_the_store(ray_up, tmp_path: Path):
    import ray

    store = create_store_actor(tmp_path / "records", 10_000)
    ids = ["e-a", "e-b", "e-c"]
    for execution_id in ids:
        ray.get(store.register.remote(execution_id))
        ray.get(store.add_many.remote([(call(execution_id, i), None) for i in range(12)]))
    paths = {e: ray.get(store.finish_execution.remote(e)) for e in ids}
    expected = {e: ray.get(store.records.remote(e)) for e in ids}
    assert all(Path(p).is_file() for p in paths.values())

    got, via_store = finished_records(store, paths)
    assert got == expected and via_store == 0  # every file seen whole here: none through the actor

    # a file this process cannot see (another node) and one that is not the store's (fewer records)
    foreign = tmp_path / "elsewhere.jsonl"
    write_jsonl(foreign, expected["e-c"][:5])
    moved = {**paths, "e-b": str(tmp_path / "no-such-node" / "e-b.jsonl"), "e-c": str(foreign)}
    got, via_store = finished_records(store, moved)
    assert got == expected and via_store == 2
    assert list(got) == ids  # in the order asked


def test_a_file_is_read_only_when_whole(tmp_path: Path):
    path = tmp_path / "e.jsonl"
    records = [call("e", i, prompt=50) for i in range(4)]
    write_jsonl(path, records)
    assert read_complete_file(str(path), 4) == records
    assert read_complete_file(str(path), 5) is None  # the store holds more: not its file
    assert read_complete_file(str(tmp_path / "absent.jsonl"), 4) is None
    assert read_complete_file("", 0) is None
    path.write_text("{not json\n")
    assert read_complete_file(str(path), 1) is None
