"""Group processing off the scheduling path: a Ray task that reads the record store directly.

When every execution of a group (one task, `group_size` runs) has ended, the scheduler submits
`process_group`: it finishes each execution through the proxy (its pending records reach the store,
which spills them to the run folder), reads the records from the store actor directly, builds trees, selects and
packs paths, group-normalises advantages and cuts micro-batches (`training_batches_with_stats`). It
returns the micro-batches, each execution's figures (calls, tokens, kept trajectories) and, per
micro-batch, how many loss tokens each policy version generated (the staleness histogram's input).
"""

from __future__ import annotations

import functools
from dataclasses import dataclass, field
from typing import Any

from gyre_ray.trainers.batch import MicroBatch


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


@functools.lru_cache(maxsize=4)
def _decoder(model_json: str) -> Any:
    import json

    from gyre_ray.model import load_tokenizer_and_args
    from gyre_ray.model.config import ModelSection

    tokenizer, args = load_tokenizer_and_args(ModelSection.model_validate(json.loads(model_json)))
    return tokenizer.decode, args.vocab_size


def loss_token_versions(batch: MicroBatch) -> dict[int, int]:
    """Loss tokens of a micro-batch counted by the policy version that generated them."""
    versions = batch.tensors["versions"][batch.tensors["loss_mask"].bool()]
    values, counts = versions.unique(return_counts=True)
    return {int(v): int(c) for v, c in zip(values.tolist(), counts.tolist(), strict=True)}


def finish_through_proxy(proxy: dict[str, str], execution_ids: list[str]) -> None:
    """Finish each execution through the proxy's admin API: the replica hands over its pending records,
    the store spills them to the run folder, and the replica forgets the execution's caches."""
    import httpx

    headers = {"Authorization": f"Bearer {proxy['admin_token']}"}
    with httpx.Client(base_url=proxy["base_url"], headers=headers, timeout=120.0) as client:
        for execution_id in execution_ids:
            client.post(f"/gyre/executions/{execution_id}/finish").raise_for_status()


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
    import json

    import ray

    from gyre_ray.config import GyreConfig
    from gyre_ray.trajectory.pipeline import training_batches_with_stats

    cfg = GyreConfig.model_validate(cfg_json)
    decode, vocab_size = _decoder(json.dumps(cfg_json["model"], sort_keys=True))
    ids = [o["execution_id"] for o in outcomes]
    if proxy is not None:
        finish_through_proxy(proxy, ids)
    else:
        ray.get([store.finish_execution.remote(e) for e in ids], timeout=300)
    records_list = ray.get([store.records.remote(e) for e in ids], timeout=300)
    all_records = dict(zip(ids, records_list, strict=True))
    valid = {o["execution_id"]: o for o in outcomes if o["valid"]}
    records = {e: all_records[e] for e in valid}
    rewards = {e: float(o["reward"]) for e, o in valid.items()}
    batches, trees = training_batches_with_stats(
        records, rewards, dict.fromkeys(records, group), cfg, decode=decode, vocab_size=vocab_size
    )
    kept = {t["execution_id"]: t["paths_selected"] for t in trees}
    executions = {
        e: {
            "calls": len(recs),
            "tokens": sum(len(r.input_ids) + len(r.output_ids) for r in recs),
            "trajectories": kept.get(e, 0),
        }
        for e, recs in all_records.items()
    }
    return GroupResult(group, batches, [loss_token_versions(b) for b in batches], executions, trees)
