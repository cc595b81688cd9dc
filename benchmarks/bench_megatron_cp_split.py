"""Context-parallel splits side by side: how evenly a long row's work falls on the ranks (balanced, zigzag, contiguous).

The widest micro-batch of one long synthetic agent execution (`bench_tree_mask.widest_batch`) trained
once (`forward_backward`) by `--ranks` context-parallel rank processes of the Megatron trainer (tiny
model, float32, tree core attention, gloo on 127.0.0.1, one thread each), once per
`trainer.context_parallel_split`. Per rank: the attention's query x key pairs (its plan, exact) and the
CPU seconds of the step (`time.process_time`; the ranks share this machine's cores, so CPU time, not
wall time, is what each rank's work costs). A step takes as long as its busiest rank: the figure is
max / mean over the ranks. The gradient norms of the three splits must agree. Saves
benchmarks/results/megatron_cp_split_cpu<cores>.json.
"""

from __future__ import annotations

import argparse
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from bench_megatron_cp import measure  # noqa: E402
from bench_tree_mask import save  # noqa: E402


def imbalance(values: list[float]) -> float:
    """The busiest rank over the mean rank."""
    return max(values) / (sum(values) / len(values))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--turns", type=int, default=5, help="main calls per context of the execution")
    parser.add_argument("--ranks", type=int, default=4, help="context-parallel ranks")
    args = parser.parse_args()
    from gyre_ray.model.arch import ModelArgs
    from gyre_ray.model.checkpoint import save_hf
    from gyre_ray.model.qwen3 import Qwen3ForCausalLM, init_weights

    with tempfile.TemporaryDirectory() as tmp:
        tiny = ModelArgs.tiny()
        folder = str(save_hf(init_weights(Qwen3ForCausalLM(tiny), seed=0), tiny, Path(tmp) / "hf"))
        runs = [
            measure(args.ranks, args.turns, folder, split) for split in ("contiguous", "zigzag", "balanced")
        ]
    print(
        f"{'split':>10} {'T':>7} {'attention pairs per rank (M)':>34} {'cpu s per rank':>24} {'grad norm':>12}"
    )
    for run in runs:
        run["pairs_max_over_mean"] = round(imbalance([r["attention_pairs"] for r in run["ranks"]]), 3)
        run["cpu_max_over_mean"] = round(imbalance([r["cpu_s"] for r in run["ranks"]]), 3)
        run["cpu_max_s"] = max(r["cpu_s"] for r in run["ranks"])
        pairs = ", ".join(f"{r['attention_pairs'] / 1e6:.1f}" for r in run["ranks"])
        cpus = ", ".join(f"{r['cpu_s']:.1f}" for r in run["ranks"])
        print(f"{run['split']:>10} {run['tokens']:>7} {pairs:>34} {cpus:>24} {run['grad_norm']:>12.8g}")
        print(
            f"{'':>10} busiest / mean rank: pairs {run['pairs_max_over_mean']}, cpu {run['cpu_max_over_mean']}"
        )
    contiguous, zigzag, balanced = runs
    save(
        "megatron_cp_split",
        "tiny (ModelArgs.tiny(), float32, 1 thread per rank), Megatron local spec, tree core attention",
        runs=runs,
        busiest_rank_cpu_contiguous_over_balanced=round(contiguous["cpu_max_s"] / balanced["cpu_max_s"], 3),
        busiest_rank_cpu_zigzag_over_balanced=round(zigzag["cpu_max_s"] / balanced["cpu_max_s"], 3),
        grad_norm_max_relative_gap=max(abs(r["grad_norm"] - contiguous["grad_norm"]) for r in runs)
        / contiguous["grad_norm"],
    )


if __name__ == "__main__":
    main()
