"""The trajectory store: executions, their API keys and their call records, with bounded memory.

A plain class (unit-testable) that the proxy runs as one Ray actor (`TrajectoryStoreActor`). It keeps
each execution's records in memory until `finish_execution` (or memory pressure) spills them to
`<records_dir>/<execution_id>.jsonl` in the call-record JSONL format of `gyre_ray.trajectory.records`.
It also holds each execution's *splice index*: what the client saw of each recorded output (its
`assistant_key`) -> the exact output token ids, so a re-sent assistant turn is rendered token-exact.

`durable=True` (the runtime's store with `proxy.durable_records`): every record is appended to its
execution's file when the store applies it (fsync'd per batch, before the batch is acknowledged),
nothing waits in memory, and registrations go to a registry file (`gyre_ray.proxy.store_files`).
A store actor Ray starts again after its process died replays them: every execution,
its key (checked by digest), its records, its splice index. A batch the dead store was applying is
sent again by Ray's task retry; records already on file (same call id) are not added twice.

`close_execution` revokes an execution's key when its harness has ended (`execution_for_key` answers
None, as for an unknown key, in a restarted store too), so nothing the agent left behind, such as
code its judge runs, calls the model under it; the records of calls already let in are still added.
`finish_execution` closes it for good: its key is revoked and records sent for it afterwards are
refused (counted in `rejected_records`). A restarted store does not read a finished execution's file back (the registry
says how many records it holds).
"""

from __future__ import annotations

import re
import secrets
import threading
from collections import OrderedDict
from pathlib import Path
from typing import Any

from gyre_ray.proxy import store_files
from gyre_ray.recent import put_recent
from gyre_ray.trajectory.records import CallRecord

EXECUTION_ID = re.compile(r"^[A-Za-z0-9_-][A-Za-z0-9_.-]{0,127}$")
SPLICE_ENTRIES_PER_EXECUTION = 4096


class StoreError(ValueError):
    """A store request that cannot be honoured (unknown or duplicate execution, bad id)."""


class _Execution:
    def __init__(self, execution_id: str, api_key: str | None, metadata: dict[str, Any]) -> None:
        self.execution_id = execution_id
        self.api_key = api_key  # None: restored from the registry (only its digest is kept), or finished
        self.key_digest: str | None = None  # restored: the digest its key is known by (`_by_digest`)
        self.restored = False
        self.call_ids: set[str] = set()  # durable mode: call ids on file (not finished executions)
        self.chunks: set[str] = set()  # prompt chunks its file holds (`record_chunks`; not finished ones)
        self.metadata = metadata
        self.records: list[CallRecord] = []  # not yet spilled
        self.spilled = 0
        self.closed = False  # its key revoked (its harness ended, or finished); records added until finished
        self.finished = False
        self.splice: OrderedDict[str, tuple[str, list[int]]] = OrderedDict()  # key -> (call_id, output ids)
        self.call_counter = 0


class TrajectoryStore:
    """Executions, keys, call records (spilled to JSONL) and the splice index."""

    def __init__(
        self,
        records_dir: str | Path,
        max_records_in_memory: int = 20_000,
        durable: bool = False,
        fsync: bool = True,
        restore: bool | None = None,
    ) -> None:
        self.records_dir = Path(records_dir)
        self.max_records_in_memory = max_records_in_memory
        self._executions: dict[str, _Execution] = {}
        self._by_key: dict[str, str] = {}
        self._by_digest: dict[str, str] = {}  # restored executions: key digest -> id
        self._finished_keys: dict[str, str] = {}  # finished executions: their revoked key's digest -> id
        self._in_memory = 0
        self._rejected = 0
        self._duplicates = 0
        self._lock = threading.Lock()
        self.fsync = fsync
        self._registry = store_files.Registry(self.records_dir, fsync) if durable else None
        if restore is None:  # the actor Ray started again after its process died: take its state back
            restore = actor_was_restarted()
        if self._registry is not None and restore:
            self._replay()
        elif self._registry is not None:  # a new store (a new run, or a resumed one): a new registry
            self._registry.reset()

    # ---- executions and keys -------------------------------------------------------------------
    def register(
        self, execution_id: str | None = None, metadata: dict[str, Any] | None = None
    ) -> dict[str, str]:
        """Create an execution and its API key; returns {"execution_id", "api_key"}."""
        with self._lock:
            if execution_id is None:
                execution_id = "exec-" + secrets.token_hex(8)
            if not isinstance(execution_id, str) or not EXECUTION_ID.fullmatch(execution_id):
                raise StoreError(f"execution_id {execution_id!r} must match {EXECUTION_ID.pattern}")
            api_key = "gyre-" + secrets.token_urlsafe(24)
            known = self._executions.get(execution_id)
            if known is not None and not self._retried_register(known):
                raise StoreError(f"execution {execution_id!r} is already registered")
            if known is not None:  # its register reached the dead store, whose answer was lost: new key
                self._rekey(known, api_key)
            else:
                self._executions[execution_id] = _Execution(execution_id, api_key, dict(metadata or {}))
                if self._registry is not None:
                    self._registry.registered(execution_id, api_key, dict(metadata or {}))
                self._by_key[api_key] = execution_id
            return {"execution_id": execution_id, "api_key": api_key}

    @staticmethod
    def _retried_register(ex: _Execution) -> bool:
        """A register of an execution restored from the registry, with no record yet: the call Ray
        sends again after the store died (only the runtime registers executions by id)."""
        return ex.restored and ex.spilled == 0 and not ex.closed

    def execution_for_key(self, api_key: str) -> str | None:
        """The execution an API key names, or None (also for a finished execution's key: revoked)."""
        found = self._by_key.get(api_key)
        if found is None and self._by_digest:
            found = self._by_digest.get(store_files.key_digest(api_key))
        return found

    def finished_execution_for_key(self, api_key: str) -> str | None:
        """The finished execution whose (revoked) key `api_key` was, or None: lets the proxy say why a
        key it refuses no longer works."""
        if not self._finished_keys:
            return None
        return self._finished_keys.get(store_files.key_digest(api_key))

    def _rekey(self, ex: _Execution, api_key: str) -> None:
        """`api_key` is `ex`'s key from now on; its old key (or key digest) no longer names it."""
        self._by_key.pop(ex.api_key, None)
        self._by_digest.pop(ex.key_digest, None)
        ex.api_key, ex.key_digest, ex.restored = api_key, None, False
        self._by_key[api_key] = ex.execution_id
        if self._registry is not None:
            self._registry.rekeyed(ex.execution_id, api_key)

    def execution_info(self, execution_id: str) -> dict[str, Any]:
        ex = self._get(execution_id)
        return {
            "execution_id": ex.execution_id,
            "metadata": ex.metadata,
            "closed": ex.closed,
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
        if self._registry is not None:
            return self.add_many([(record, splice_key)])
        with self._lock:
            ex = self._get(record.execution_id)
            if ex.finished:
                raise StoreError(f"execution {ex.execution_id!r} has finished: no record is added to it")
            ex.records.append(record)
            self._in_memory += 1
            if splice_key is not None and record.output_ids:
                self._index_splice(ex, splice_key, record.call_id, list(record.output_ids))
            if self._in_memory > self.max_records_in_memory:
                self._spill_oldest()

    def add_many(self, items: list[tuple[CallRecord, str | None]]) -> None:
        """`add` for each (record, splice key), in order: a proxy hands over its records in batches.

        A record of an unknown or finished execution is counted (`rejected_records`) without stopping
        the batch.
        """
        if self._registry is not None:
            return self._add_durably(items)
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

    def close_execution(self, execution_id: str) -> dict[str, Any]:
        """Revoke the execution's key (its harness has ended): no new call is let in under it, and the
        records of calls already let in are still added until `finish_execution`. Returns
        `execution_info`. Closing twice, or after the finish, changes nothing."""
        with self._lock:
            ex = self._get(execution_id)
            if not ex.closed:
                if self._registry is not None:
                    self._registry.closed(execution_id)
                ex.closed = True
                self._revoke(ex)
        return self.execution_info(execution_id)

    def finish_execution(self, execution_id: str) -> str:
        """Spill the execution's records to disk and stop keeping them (and its splice index) in memory;
        returns the file path. Its key is revoked (`execution_for_key` no longer knows it) and no record
        is added to it any more. What stays is its metadata (a few hundred bytes)."""
        with self._lock:
            ex = self._get(execution_id)
            self._spill(ex)
            if self._registry is not None and not ex.finished:
                self._registry.finished(execution_id, ex.spilled)
            ex.finished = ex.closed = True
            self._revoke(ex)
            ex.splice.clear()
            ex.call_ids.clear()
            ex.chunks.clear()
            return str(self._path(ex))

    def stats(self) -> dict[str, int]:
        return {
            "executions": len(self._executions),
            "records_in_memory": self._in_memory,
            "finished": sum(ex.finished for ex in self._executions.values()),
            "rejected_records": self._rejected,
            "records": sum(ex.spilled + len(ex.records) for ex in self._executions.values()),
            "duplicate_records": self._duplicates,
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
        store_files.append_records(self._path(ex), records, False, ex.chunks)
        ex.spilled += len(records)

    def _spill(self, ex: _Execution) -> None:
        if ex.records or not self._path(ex).exists():
            self._append_file(ex, ex.records)
        self._in_memory -= len(ex.records)
        ex.records = []

    def _add_durably(self, items: list[tuple[CallRecord, str | None]]) -> None:
        """Durable mode: each execution's new records in one append + fsync; splice keys likewise."""
        with self._lock:
            by_execution: dict[str, list[tuple[CallRecord, str | None]]] = {}
            batch_ids: set[tuple[str, str]] = set()
            for record, splice_key in items:
                ex = self._executions.get(record.execution_id)
                if ex is None or ex.finished:
                    self._rejected += 1
                elif record.call_id in ex.call_ids or (ex.execution_id, record.call_id) in batch_ids:
                    self._duplicates += 1  # sent again after a store restart: already on file
                else:
                    batch_ids.add((ex.execution_id, record.call_id))
                    by_execution.setdefault(ex.execution_id, []).append((record, splice_key))
            for execution_id, added in by_execution.items():  # records_dir: made by the registry
                ex = self._executions[execution_id]
                # a failed append (a full disk) leaves the file as it was and raises to the caller,
                # whose batch fails: its records are not booked, so the batch sent again is taken
                store_files.append_records(self._path(ex), [r for r, _ in added], self.fsync, ex.chunks)
                ex.call_ids.update(r.call_id for r, _ in added)
                ex.spilled += len(added)
                spliced = [(key, r) for r, key in added if key is not None and r.output_ids]
                for key, record in spliced:
                    self._index_splice(ex, key, record.call_id, list(record.output_ids))
                if spliced:
                    keys = [(key, record.call_id) for key, record in spliced]
                    store_files.append_splice(self.records_dir, execution_id, keys, self.fsync)

    def _revoke(self, ex: _Execution) -> None:
        """A closed or finished execution's key names it no more (only its digest is kept, to say so)."""
        self._by_key.pop(ex.api_key, None)
        self._by_digest.pop(ex.key_digest, None)
        digest = ex.key_digest or (store_files.key_digest(ex.api_key) if ex.api_key else None)
        if digest is not None:
            self._finished_keys[digest] = ex.execution_id
        ex.api_key = ex.key_digest = None

    def _restore_digest(self, ex: _Execution, digest: str) -> None:
        self._by_digest.pop(ex.key_digest, None)
        ex.key_digest = digest
        self._by_digest[digest] = ex.execution_id

    def _index_splice(self, ex: _Execution, key: str, call_id: str, output_ids: list[int]) -> None:
        put_recent(ex.splice, key, (call_id, output_ids), SPLICE_ENTRIES_PER_EXECUTION)

    def _replay(self) -> None:
        """A store started on a folder a previous store wrote in durable mode: take its state back."""
        assert self._registry is not None
        finished: dict[str, int | None] = {}  # id -> records on file (None: an older registry's finish)
        for event in self._registry.replay():
            if "register" in event:
                ex = _Execution(event["register"], None, event.get("metadata") or {})
                ex.restored = True
                self._executions[ex.execution_id] = ex
                self._restore_digest(ex, event["key_sha256"])
            elif "rekey" in event and event["rekey"] in self._executions:
                self._restore_digest(self._executions[event["rekey"]], event["key_sha256"])
            elif "close" in event and event["close"] in self._executions:
                self._executions[event["close"]].closed = True
            elif "finish" in event and event["finish"] in self._executions:
                done = self._executions[event["finish"]]
                done.finished = done.closed = True
                finished[event["finish"]] = event.get("records")
        for ex in self._executions.values():
            if ex.closed:
                self._revoke(ex)
            if ex.finished:  # nothing of its file is needed but how many records it holds
                count = finished.get(ex.execution_id)
                ex.spilled = count if isinstance(count, int) else store_files.count_records(self._path(ex))
                continue
            ex.spilled, outputs = store_files.scan_records(self._path(ex), ex.chunks)
            ex.call_ids = set(outputs)
            for key, call_id in store_files.read_splice(self.records_dir, ex.execution_id):
                if call_id in outputs and outputs[call_id]:
                    self._index_splice(ex, key, call_id, outputs[call_id])

    def _spill_oldest(self) -> None:
        """Spill executions (oldest registered first) until memory is at most half the bound."""
        target = self.max_records_in_memory // 2
        for ex in self._executions.values():
            if self._in_memory <= target:
                break
            if ex.records:
                self._spill(ex)


def actor_was_restarted() -> bool:
    """True inside an actor that Ray restarted after its process died (False outside an actor)."""
    import warnings

    import ray

    if not ray.is_initialized():  # an in-process store: asking the runtime context would start a Ray
        return False
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # Ray's own deprecation warning inside this call
        try:
            return bool(ray.get_runtime_context().was_current_actor_reconstructed)
        except Exception:
            return False


def _store_actor_class() -> Any:
    import ray

    return ray.remote(num_cpus=0, max_concurrency=1)(TrajectoryStore)


STORE_RESTARTS = 10  # restarts of a durable store actor in a run (each replays its files)


def create_store_actor(
    records_dir: str | Path,
    max_records_in_memory: int,
    name: str | None = None,
    namespace: str | None = None,
    detached: bool = False,
    resources: dict[str, float] | None = None,
    durable: bool = False,
    fsync: bool = True,
) -> Any:
    """Start the store as a Ray actor (sequential: calls from one caller are applied in order).

    `resources`: custom resources it asks for (e.g. the head node's, to run there). `durable`: records
    and registrations on file as they come (see the module docstring); Ray restarts the actor when
    its process dies and sends the calls in flight again, which the new one answers from its files."""
    cls = _store_actor_class()
    options: dict[str, Any] = {"resources": dict(resources)} if resources else {}
    if name is not None:
        options.update(name=name, namespace=namespace)
    if detached:
        options["lifetime"] = "detached"
    if durable:
        options.update(max_restarts=STORE_RESTARTS, max_task_retries=-1)
    return cls.options(**options).remote(str(records_dir), max_records_in_memory, durable, fsync)
