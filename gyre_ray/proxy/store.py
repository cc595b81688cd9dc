"""The trajectory store: executions, their API keys and their call records, with bounded memory.

A plain class (unit-testable) that the proxy runs as one Ray actor (`TrajectoryStoreActor`). It keeps
each execution's records in memory until `finish_execution` (or memory pressure) spills them to
`<records_dir>/<execution_id>.jsonl` in the call-record JSONL format of `gyre_ray.trajectory.records`.
It also holds each execution's *splice index*: what the client saw of each recorded output (its
`assistant_key`) -> the exact output token ids, so a re-sent assistant turn is rendered token-exact.
"""

from __future__ import annotations

import re
import secrets
import threading
from collections import OrderedDict
from pathlib import Path
from typing import Any

from gyre_ray.trajectory.records import CallRecord

EXECUTION_ID = re.compile(r"^[A-Za-z0-9_-][A-Za-z0-9_.-]{0,127}$")
SPLICE_ENTRIES_PER_EXECUTION = 4096


class StoreError(ValueError):
    """A store request that cannot be honoured (unknown or duplicate execution, bad id)."""


class _Execution:
    def __init__(self, execution_id: str, api_key: str, metadata: dict[str, Any]) -> None:
        self.execution_id = execution_id
        self.api_key = api_key
        self.metadata = metadata
        self.records: list[CallRecord] = []  # not yet spilled
        self.spilled = 0
        self.finished = False
        self.splice: OrderedDict[str, tuple[str, list[int]]] = OrderedDict()  # key -> (call_id, output ids)
        self.call_counter = 0


class TrajectoryStore:
    """Executions, keys, call records (spilled to JSONL) and the splice index."""

    def __init__(self, records_dir: str | Path, max_records_in_memory: int = 20_000) -> None:
        self.records_dir = Path(records_dir)
        self.max_records_in_memory = max_records_in_memory
        self._executions: dict[str, _Execution] = {}
        self._by_key: dict[str, str] = {}
        self._in_memory = 0
        self._rejected = 0
        self._lock = threading.Lock()

    # ---- executions and keys -------------------------------------------------------------------
    def register(
        self, execution_id: str | None = None, metadata: dict[str, Any] | None = None
    ) -> dict[str, str]:
        """Create an execution and its API key; returns {"execution_id", "api_key"}."""
        with self._lock:
            if execution_id is None:
                execution_id = "exec-" + secrets.token_hex(8)
            if not isinstance(execution_id, str) or not EXECUTION_ID.match(execution_id):
                raise StoreError(f"execution_id {execution_id!r} must match {EXECUTION_ID.pattern}")
            if execution_id in self._executions:
                raise StoreError(f"execution {execution_id!r} is already registered")
            api_key = "gyre-" + secrets.token_urlsafe(24)
            self._executions[execution_id] = _Execution(execution_id, api_key, dict(metadata or {}))
            self._by_key[api_key] = execution_id
            return {"execution_id": execution_id, "api_key": api_key}

    def execution_for_key(self, api_key: str) -> str | None:
        """The execution an API key names, or None."""
        return self._by_key.get(api_key)

    def execution_info(self, execution_id: str) -> dict[str, Any]:
        ex = self._get(execution_id)
        return {
            "execution_id": ex.execution_id,
            "metadata": ex.metadata,
            "finished": ex.finished,
            "num_records": ex.spilled + len(ex.records),
        }

    def list_executions(self) -> list[str]:
        return list(self._executions)

    def next_call_id(self, execution_id: str) -> str:
        """A call id unique within the execution (`call-000001`, ...)."""
        with self._lock:
            ex = self._get(execution_id)
            ex.call_counter += 1
            return f"call-{ex.call_counter:06d}"

    # ---- records -----------------------------------------------------------------------------------
    def add(self, record: CallRecord, splice_key: str | None = None) -> None:
        """Keep a call record; if `splice_key` is given, index its output ids under it."""
        with self._lock:
            ex = self._get(record.execution_id)
            if ex.finished:
                self._append_file(ex, [record])
            else:
                ex.records.append(record)
                self._in_memory += 1
            if splice_key is not None and record.output_ids:
                ex.splice[splice_key] = (record.call_id, list(record.output_ids))
                ex.splice.move_to_end(splice_key)
                while len(ex.splice) > SPLICE_ENTRIES_PER_EXECUTION:
                    ex.splice.popitem(last=False)
            if self._in_memory > self.max_records_in_memory:
                self._spill_oldest()

    def add_many(self, items: list[tuple[CallRecord, str | None]]) -> None:
        """`add` for each (record, splice key), in order: a proxy hands over its records in batches.

        A record of an unknown execution is counted (`rejected_records`) without stopping the batch.
        """
        for record, splice_key in items:
            try:
                self.add(record, splice_key)
            except StoreError:
                self._rejected += 1

    def find_outputs(self, execution_id: str, keys: list[str]) -> dict[str, tuple[str, list[int]]]:
        """(call id, recorded output ids) of those `keys` that are in the execution's splice index."""
        ex = self._executions.get(execution_id)
        if ex is None:
            return {}
        return {key: ex.splice[key] for key in keys if key in ex.splice}

    def records(self, execution_id: str) -> list[CallRecord]:
        """All records of an execution in call order (spilled ones read back from disk)."""
        from gyre_ray.trajectory.records import read_jsonl

        with self._lock:
            ex = self._get(execution_id)
            spilled = read_jsonl(self._path(ex)) if ex.spilled else []
            return spilled + list(ex.records)

    def records_jsonl(self, execution_id: str) -> str:
        """The execution's records as JSONL text."""
        return "".join(record.to_json() + "\n" for record in self.records(execution_id))

    def finish_execution(self, execution_id: str) -> str:
        """Spill the execution's records to disk and stop keeping them (and its splice index) in memory;
        returns the file path. What stays is its key and metadata (a few hundred bytes)."""
        with self._lock:
            ex = self._get(execution_id)
            self._spill(ex)
            ex.finished = True
            ex.splice.clear()  # a (rare) call after the end is encoded afresh, not spliced
            return str(self._path(ex))

    def stats(self) -> dict[str, int]:
        return {
            "executions": len(self._executions),
            "records_in_memory": self._in_memory,
            "finished": sum(ex.finished for ex in self._executions.values()),
            "rejected_records": self._rejected,
        }

    # ---- internals --------------------------------------------------------------------------------
    def _get(self, execution_id: str) -> _Execution:
        ex = self._executions.get(execution_id)
        if ex is None:
            raise StoreError(f"unknown execution {execution_id!r}")
        return ex

    def _path(self, ex: _Execution) -> Path:
        return self.records_dir / f"{ex.execution_id}.jsonl"

    def _append_file(self, ex: _Execution, records: list[CallRecord]) -> None:
        self.records_dir.mkdir(parents=True, exist_ok=True)
        with open(self._path(ex), "a", encoding="utf-8") as fh:
            for record in records:
                fh.write(record.to_json() + "\n")
        ex.spilled += len(records)

    def _spill(self, ex: _Execution) -> None:
        if ex.records or not self._path(ex).exists():
            self._append_file(ex, ex.records)
        self._in_memory -= len(ex.records)
        ex.records = []

    def _spill_oldest(self) -> None:
        """Spill executions (oldest registered first) until memory is at most half the bound."""
        target = self.max_records_in_memory // 2
        for ex in self._executions.values():
            if self._in_memory <= target:
                break
            if ex.records:
                self._spill(ex)


def _store_actor_class() -> Any:
    import ray

    return ray.remote(num_cpus=0, max_concurrency=1)(TrajectoryStore)


def create_store_actor(
    records_dir: str | Path,
    max_records_in_memory: int,
    name: str | None = None,
    namespace: str | None = None,
    detached: bool = False,
    resources: dict[str, float] | None = None,
) -> Any:
    """Start the store as a Ray actor (sequential: calls from one caller are applied in order).

    `resources`: custom resources it asks for (e.g. the head node's, to run there)."""
    cls = _store_actor_class()
    options: dict[str, Any] = {"resources": dict(resources)} if resources else {}
    if name is not None:
        options.update(name=name, namespace=namespace)
    if detached:
        options["lifetime"] = "detached"
    return cls.options(**options).remote(str(records_dir), max_records_in_memory)
