"""Context parallelism on a long packed row: per-rank peak memory of the Megatron trainer, 1 vs 2 ranks.

The widest micro-batch of one long synthetic agent execution (`bench_tree_mask.widest_batch`, the
real trajectory pipeline), trained once (`forward_backward`, GSPO loss, on-policy, advantages 1) on
the tiny model (float32, local spec, tree core attention) by `trainer.context_parallel_size` = 1 and
= 2 rank processes (gloo over 127.0.0.1, one thread each, the ranks `tensor_parallel.build_rank`
builds). Each rank reports its peak resident memory above its own baseline (trainer built, batch
made); the gradient norm of the result must agree. Saves benchmarks/results/megatron_cp_cpu<cores>.json.
"""

from __future__ import annotations

import argparse
import multiprocessing as mp
import resource
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from bench_tree_mask import save, widest_batch  # noqa: E402


def _rank(
    rank: int, port: int, cp: int, turns: int, folder: str, out: mp.Queue, split: str = "balanced"
) -> None:
    import torch

    from gyre_ray.algo.config import AlgoSection
    from gyre_ray.algo.gspo import make_tree_gspo_loss
    from gyre_ray.model.checkpoint import load_hf
    from gyre_ray.model.tree_attention import plan_tree
    from gyre_ray.trainers.config import TrainerSection
    from gyre_ray.trainers.megatron.context_parallel import share_of
    from gyre_ray.trainers.megatron.tensor_parallel import HOST, build_rank, rank_init

    model, args = load_hf(folder)
    section = TrainerSection(backend="megatron", context_parallel_size=cp, context_parallel_split=split)
    init = rank_init(model.state_dict(), args, section, make_tree_gspo_loss(AlgoSection()), 0)
    del model
    trainer = build_rank(rank, HOST, port, init, threads=1)
    batch, calls = widest_batch(turns)
    mask = batch.tensors["loss_mask"]
    current = trainer.compute_logprobs(batch).detach()
    batch.tensors["old_logprobs"] = torch.where(mask, current, torch.zeros_like(current))  # on-policy
    batch.tensors["path_advantages"] = torch.ones_like(batch.tensors["path_advantages"])
    baseline = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024
    cpu = time.process_time()
    trainer.forward_backward(batch)
    cpu = time.process_time() - cpu
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024 - baseline
    grads = trainer.export_grads()
    norm = float(torch.linalg.vector_norm(torch.stack([g.norm() for g in grads.values()])))
    share = share_of(batch, cp, rank, split)
    pairs = plan_tree(share.layout, args.num_attention_heads, queries=share.ranges).visited_pairs
    out.put({"rank": rank, "tokens": int(batch.input_ids.size(1)), "calls": calls, "grad_norm": norm,
             "peak_rss_above_baseline_mib": round(peak, 1), "cpu_s": round(cpu, 2),
             "attention_pairs": pairs})  # fmt: skip


def measure(cp: int, turns: int, folder: str, split: str = "balanced") -> dict:
    """`cp` rank processes training the widest row once (columns split `split`): per rank peak memory,
    CPU seconds and the attention's query x key pairs."""
    import torch.distributed as dist

    from gyre_ray.trainers.megatron.tensor_parallel import HOST

    store = dist.TCPStore(HOST, 0, world_size=cp, is_master=True, wait_for_workers=False)
    ctx = mp.get_context("spawn")
    out = ctx.Queue()
    procs = [
        ctx.Process(target=_rank, args=(r, store.port, cp, turns, folder, out, split)) for r in range(cp)
    ]
    for proc in procs:
        proc.start()
    ranks = sorted((out.get(timeout=1800) for _ in procs), key=lambda r: r["rank"])
    for proc in procs:
        proc.join()
    return {
        "context_parallel_size": cp,
        "split": split,
        "tokens": ranks[0]["tokens"],
        "calls": ranks[0]["calls"],
        "grad_norm": ranks[0]["grad_norm"],
        "ranks": ranks,
        "max_rank_peak_mib": max(r["peak_rss_above_baseline_mib"] for r in ranks),
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--turns", type=int, default=5, help="main calls per context of the execution")
    args = parser.parse_args()
    from gyre_ray.model.arch import ModelArgs
    from gyre_ray.model.checkpoint import save_hf
    from gyre_ray.model.qwen3 import Qwen3ForCausalLM, init_weights

    with tempfile.TemporaryDirectory() as tmp:
        tiny = ModelArgs.tiny()
        folder = str(save_hf(init_weights(Qwen3ForCausalLM(tiny), seed=0), tiny, Path(tmp) / "hf"))
        runs = [measure(cp, args.turns, folder) for cp in (1, 2)]
    print(f"{'ranks':>5} {'T':>7} {'peak MiB per rank':>24} {'cpu s per rank':>20} {'grad norm':>12}")
    for run in runs:
        peaks = ", ".join(f"{r['peak_rss_above_baseline_mib']:.0f}" for r in run["ranks"])
        cpus = ", ".join(f"{r['cpu_s']:.1f}" for r in run["ranks"])
        print(
            f"{run['context_parallel_size']:>5} {run['tokens']:>7} {peaks:>24} {cpus:>20} {run['grad_norm']:>12.8g}"
        )
    one, two = runs
    save(
        "megatron_cp",
        "tiny (ModelArgs.tiny(), float32, 1 thread per rank), Megatron local spec, tree core attention",
        runs=runs,
        peak_ratio_one_over_two=round(one["max_rank_peak_mib"] / max(1.0, two["max_rank_peak_mib"]), 2),
        grad_norm_relative_gap=abs(one["grad_norm"] - two["grad_norm"]) / one["grad_norm"],
    )


if __name__ == "__main__":
    main()
