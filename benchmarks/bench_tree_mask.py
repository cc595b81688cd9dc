"""Long packed rows: tree attention planned from segments vs the dense (T, T) mask, side by side.

Each case is one long agent execution (`gyre_ray.trajectory.synthetic`: a main agent with one
compaction and two sub-agents, `--turns` main calls a context, long tool results) put through the
real trajectory pipeline (trees, path selection, packing, `split_roots`, `micro_batches`); its widest
micro-batch, one row of T tokens, is trained once (forward + backward of the per-token log-probs)
on the tiny model (`ModelArgs.tiny()`, float32, one thread) in two ways, each in a fresh process so
that its peak memory is its own:

- `dense`: the (1, T, T) bool mask the trajectory packer used to hand out, planned into shared query
  blocks (`gyre_ray.model.attention.plan_attention`), as before this change;
- `tree`: the micro-batch's `TreeLayout` (segments), planned row by row without a dense mask
  (`gyre_ray.model.tree_attention`).

Per case: T, the query x key pairs the tree lets the row see, the bytes of the mask (or layout) a
micro-batch carries through the object store, the peak resident memory above the process's
baseline, and CPU seconds. A last, plan-only case is the scale of a real long run (`--plan-turns`:
the dense mask of its widest row would not fit this machine): planning time, the plan's stored mask
entries and the layout's pickled size. Results go to benchmarks/results/tree_mask_cpu<cores>.json.
"""

from __future__ import annotations

import argparse
import json
import os
import pickle
import platform
import resource
import subprocess
import sys
import time
from pathlib import Path
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from gyre_ray.trainers.batch import MicroBatch

RESULTS = Path(__file__).resolve().parent / "results"


def widest_batch(turns: int, seed: int = 0) -> tuple[MicroBatch, int]:
    """The widest micro-batch of one long synthetic execution (real pipeline, default packing)."""
    from gyre_ray.model.arch import ModelArgs
    from gyre_ray.trajectory.batching import micro_batches
    from gyre_ray.trajectory.packing import pack_paths
    from gyre_ray.trajectory.pieces import split_roots
    from gyre_ray.trajectory.pipeline import process_execution
    from gyre_ray.trajectory.synthetic import SyntheticWorkload, synthetic_execution

    workload = SyntheticWorkload(
        system_tokens=2048,
        segments=(2, 2),
        turns=(turns, turns),
        output_tokens=(100, 300),
        tool_tokens=(600, 1000),
        max_subagents=2,
        subagent_turns=(3, 5),
        vocab_size=ModelArgs.tiny().vocab_size,
    )
    records, _ = synthetic_execution("long", seed, workload)
    sample = pack_paths("long", process_execution(records).selected)
    batches = micro_batches(split_roots(sample), row_tokens=1024, micro_batch_tokens=8192)
    return max(batches, key=lambda b: b.input_ids.size(1)), len(records)


def _max_rss_mib() -> float:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024


def measure(mode: str, turns: int) -> dict:
    """One case in this process: build the mask, then forward + backward once."""
    import torch

    from gyre_ray.model.arch import ModelArgs
    from gyre_ray.model.qwen3 import Qwen3ForCausalLM, init_weights
    from gyre_ray.trainers.batch import MicroBatch, model_logprobs

    torch.set_num_threads(1)
    model = init_weights(Qwen3ForCausalLM(ModelArgs.tiny()), seed=0)
    batch, calls = widest_batch(turns)
    layout = batch.attention_mask
    baseline = _max_rss_mib()
    cpu = time.process_time()
    mask = layout.dense() if mode == "dense" else layout
    run = MicroBatch(batch.input_ids, batch.position_ids, batch.parent_index, mask, batch.tensors)
    carried = len(pickle.dumps(mask))
    model_logprobs(model, run).sum().backward()
    return {
        "mode": mode,
        "calls": calls,
        "tokens": int(batch.input_ids.size(1)),
        "visible_pairs": layout.visible_pairs(),
        "mask_bytes_carried": carried,
        "peak_rss_above_baseline_mib": round(_max_rss_mib() - baseline, 1),
        "cpu_s": round(time.process_time() - cpu, 2),
    }


def plan_only(turns: int) -> dict:
    """Plan the widest row of a long run without forming its dense mask."""
    import torch

    from gyre_ray.model.arch import ModelArgs
    from gyre_ray.model.tree_attention import plan_tree

    torch.set_num_threads(1)
    batch, calls = widest_batch(turns)
    layout = batch.attention_mask
    baseline = _max_rss_mib()
    cpu = time.process_time()
    plan = plan_tree(layout, ModelArgs.tiny().num_attention_heads)
    tokens = int(batch.input_ids.size(1))
    return {
        "calls": calls,
        "tokens": tokens,
        "segments": len(layout.rows[0]),
        "dense_mask_gib": round(tokens * tokens / 2**30, 1),
        "plan_cpu_s": round(time.process_time() - cpu, 2),
        "plan_blocks": len(plan.rows[0]),
        "plan_stored_mask_mib": round(plan.stored_mask_elements / 2**20, 2),
        "visited_over_visible": round(plan.visited_pairs / layout.visible_pairs(), 5),
        "layout_pickled_bytes": len(pickle.dumps(layout)),
        "peak_rss_above_baseline_mib": round(_max_rss_mib() - baseline, 1),
    }


def in_subprocess(*args: str, script: str = __file__) -> dict:
    """`script --child ARGS` in a fresh process (its peak memory its own): the JSON its last line prints."""
    out = subprocess.run(
        [sys.executable, script, "--child", *args], check=True, capture_output=True, text=True
    ).stdout
    return json.loads(out.strip().splitlines()[-1])


def side_by_side(pair: dict[str, dict]) -> dict:
    """A case's two runs and their dense / tree ratios of peak memory and CPU seconds."""
    dense, tree = pair["dense"], pair["tree"]
    return {
        **pair,
        "peak_memory_ratio_dense_over_tree": round(
            dense["peak_rss_above_baseline_mib"] / max(1.0, tree["peak_rss_above_baseline_mib"]), 2
        ),
        "cpu_ratio_dense_over_tree": round(dense["cpu_s"] / tree["cpu_s"], 2),
    }


def save(name: str, model: str, **parts: object) -> Path:
    """benchmarks/results/<name>_cpu<cores>.json with the date, the machine and the model."""
    result = {
        "benchmark": name,
        "date": time.strftime("%Y-%m-%d"),
        "machine": {
            "cpus": os.cpu_count(),
            "platform": platform.platform(),
            "python": platform.python_version(),
        },
        "model": model,
        **parts,
    }
    RESULTS.mkdir(exist_ok=True)
    path = RESULTS / f"{name}_cpu{os.cpu_count()}.json"
    path.write_text(json.dumps(result, indent=2) + "\n")
    print(f"saved {path}")
    return path


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--turns", default="3,5,8", help="main calls per context, one case each")
    parser.add_argument("--plan-turns", type=int, default=200, help="the plan-only case (0: skip)")
    parser.add_argument("--child", nargs="+", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.child:
        kind, *rest = args.child
        result = plan_only(int(rest[0])) if kind == "plan" else measure(kind, int(rest[0]))
        print(json.dumps(result))
        return
    cases = []
    print(f"{'calls':>5} {'T':>7} {'mode':>5} {'carried MiB':>11} {'peak MiB':>9} {'cpu s':>7}")
    for turns in (int(t) for t in args.turns.split(",")):
        pair = {mode: in_subprocess(mode, str(turns)) for mode in ("dense", "tree")}
        for mode, r in pair.items():
            print(
                f"{r['calls']:>5} {r['tokens']:>7} {mode:>5} {r['mask_bytes_carried'] / 2**20:>11.3f} "
                f"{r['peak_rss_above_baseline_mib']:>9.1f} {r['cpu_s']:>7.2f}"
            )
        cases.append(side_by_side(pair))
    plan = in_subprocess("plan", str(args.plan_turns)) if args.plan_turns else None
    if plan:
        print(
            f"plan only: {plan['calls']} calls, widest row {plan['tokens']} tokens (dense mask "
            f"{plan['dense_mask_gib']} GiB): {plan['plan_blocks']} blocks in {plan['plan_cpu_s']} s, "
            f"{plan['plan_stored_mask_mib']} MiB of stored mask, layout {plan['layout_pickled_bytes']} bytes"
        )
    save("tree_mask", "tiny (ModelArgs.tiny(), float32, 1 thread)", cases=cases, plan_only=plan)


if __name__ == "__main__":
    main()
