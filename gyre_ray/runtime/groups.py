"""Group processing off the scheduling path: a Ray task that reads the record store directly.

When every execution of a group (one task, `group_size` runs) has ended, the scheduler submits
`process_group`: it finishes each execution through the proxy (its pending records reach the store,
which spills them to the run folder and says which file), reads the records, builds trees, selects
and packs paths, group-normalises advantages and cuts micro-batches (`training_batches_with_stats`).
It returns the micro-batches, each execution's figures (calls, tokens, kept trajectories) and, per
micro-batch, how many loss tokens each policy version generated (the staleness histogram's input).

A finished execution's file is complete and never written again, so the records are read from it
wherever this process sees it (the store's node, which the run's workers share, or a shared file
system) and only otherwise through the store actor: the one actor that takes every model call's
record then does not spend seconds decoding and pickling a long execution (a 417-call one: 134 MiB).
"""

from __future__ import annotations

import functools
import json
import os
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from gyre_ray.algo.advantages import ZERO_ADVANTAGE
from gyre_ray.trainers.batch import MicroBatch

if TYPE_CHECKING:
    from gyre_ray.trajectory.records import CallRecord


@dataclass
class GroupResult:
    """What one processed group hands back to the scheduler."""

    group: str
    batches: list[MicroBatch]
    token_versions: list[dict[int, int]]  # per micro-batch: policy version -> loss tokens it generated
    executions: dict[str, dict[str, Any]] = field(
        default_factory=dict
    )  # exec id -> calls/tokens/trajectories
    trees: list[dict[str, Any]] = field(default_factory=list)

    @property
    def untrained(self) -> list[str]:
        """Executions of advantage 0: counted in the step's mean, not trained (their trees say so)."""
        return [t["execution_id"] for t in self.trees if t["training"] == ZERO_ADVANTAGE]


def model_decoder(model_section: dict[str, Any]) -> Any:
    """(decode, vocab size) of the tokenizer of a `model` config section (as a dict; cached)."""
    return _model_decoder(json.dumps(model_section, sort_keys=True))


@functools.lru_cache(maxsize=4)
def _model_decoder(model_json: str) -> Any:
    from gyre_ray.model import load_tokenizer_and_args
    from gyre_ray.model.config import ModelSection

    tokenizer, args = load_tokenizer_and_args(ModelSection.model_validate(json.loads(model_json)))
    return tokenizer.decode, args.vocab_size


def loss_token_versions(batch: MicroBatch) -> dict[int, int]:
    """Loss tokens of a micro-batch counted by the policy version that generated them."""
    versions = batch.tensors["versions"][batch.tensors["loss_mask"].bool()]
    values, counts = versions.unique(return_counts=True)
    return {int(v): int(c) for v, c in zip(values.tolist(), counts.tolist(), strict=True)}


def finish_through_proxy(proxy: dict[str, str], execution_ids: list[str]) -> dict[str, str]:
    """Finish each execution through the proxy's admin API: the replica hands over its pending records,
    the store spills them to the run folder, and the replica forgets the execution's caches.
    Returns each execution's records file."""
    import httpx

    headers = {"Authorization": f"Bearer {proxy['admin_token']}"}
    paths = {}
    with httpx.Client(base_url=proxy["base_url"], headers=headers, timeout=120.0) as client:
        for execution_id in execution_ids:
            response = client.post(f"/gyre/executions/{execution_id}/finish")
            response.raise_for_status()
            paths[execution_id] = str(response.json().get("records_path", ""))
    return paths


def finish_executions(
    store: Any, proxy: dict[str, str] | None, execution_ids: list[str], timeout_s: float = 300.0
) -> dict[str, str]:
    """Finish each execution (`finish_through_proxy` where `proxy` is given, else in the store, waited
    for up to `timeout_s`); returns each one's records file."""
    import ray

    if not execution_ids:
        return {}
    if proxy is not None:
        return finish_through_proxy(proxy, execution_ids)
    paths = ray.get([store.finish_execution.remote(e) for e in execution_ids], timeout=timeout_s)
    return dict(zip(execution_ids, paths, strict=True))


def read_complete_file(path: str, expected: int) -> list[CallRecord] | None:
    """The records of a finished execution's file when this process sees it whole (`expected` records),
    else None (no such file here: another node; or not the store's file)."""
    from gyre_ray.trajectory.records import RecordError, read_jsonl

    if not path or not os.path.isfile(path):
        return None
    try:
        records = read_jsonl(path)
    except (OSError, RecordError):
        return None
    return records if len(records) == expected else None


def finished_records(store: Any, paths: dict[str, str]) -> tuple[dict[str, list[CallRecord]], int]:
    """Each finished execution's records, from its file where this process sees it whole, else from
    the store actor; and how many came from the store."""
    import ray

    infos = ray.get([store.execution_info.remote(e) for e in paths], timeout=300)
    records: dict[str, list[CallRecord]] = {}
    for (execution_id, path), info in zip(paths.items(), infos, strict=True):
        found = read_complete_file(path, int(info["num_records"])) if info.get("finished") else None
        if found is not None:
            records[execution_id] = found
    missing = [e for e in paths if e not in records]
    fetched = ray.get([store.records.remote(e) for e in missing], timeout=300)
    records.update(zip(missing, fetched, strict=True))
    return {e: records[e] for e in paths}, len(missing)


def process_group(
    store: Any,
    group: str,
    outcomes: list[dict[str, Any]],
    cfg_json: dict[str, Any],
    proxy: dict[str, str] | None = None,
) -> GroupResult:
    """Records of the group's valid executions (from `store`) -> micro-batches and figures.

    With `proxy` ({"base_url", "admin_token"}) the executions are finished through it first;
    without, directly in the store.
    """

    from gyre_ray.config import GyreConfig
    from gyre_ray.trajectory.pipeline import training_batches_with_stats

    cfg = GyreConfig.model_validate(cfg_json)
    decode, vocab_size = model_decoder(cfg_json["model"])
    paths = finish_executions(store, proxy, [o["execution_id"] for o in outcomes])
    all_records, _ = finished_records(store, paths)
    valid = {o["execution_id"]: o for o in outcomes if o["valid"]}
    records = {e: all_records[e] for e in valid}
    rewards = {e: float(o["reward"]) for e, o in valid.items()}
    batches, trees = training_batches_with_stats(
        records, rewards, dict.fromkeys(records, group), cfg, decode=decode, vocab_size=vocab_size
    )
    trained = {t["execution_id"]: t["paths_selected"] for t in trees if t["training"] == "trained"}
    executions = {
        e: {
            "calls": len(recs),
            "tokens": sum(len(r.input_ids) + len(r.output_ids) for r in recs),
            "trajectories": trained.get(e, 0),  # trained ones: what the step's training cost
        }
        for e, recs in all_records.items()
    }
    return GroupResult(group, batches, [loss_token_versions(b) for b in batches], executions, trees)
