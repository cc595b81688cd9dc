"""The Megatron trainer on a long packed row: tree core attention vs Megatron's dense-mask attention.

The same cases as `bench_tree_mask.py` (the widest micro-batch of one long synthetic agent execution,
through the real trajectory pipeline, on the tiny model, float32, one thread), trained once
(`MegatronTrainer.forward_backward` with the GSPO loss, tensor parallel 1, the local layer spec), in
a fresh process each so its peak memory is its own:

- `dense`: `trainer.megatron_attention=dense`, Megatron's `DotProductAttention` over the explicit
  [B, 1, T, T] mask built from the layout (what the trainer did before);
- `tree`: `trainer.megatron_attention=tree`, `TreeCoreAttention` following the plan made from the
  row's segments (`gyre_ray/trainers/megatron/tree_core.py`).

Per case: T, peak resident memory above the process's baseline (the model and the batch loaded),
CPU seconds, the loss and the gradient norm (the two modes must agree). Saves benchmarks/results/megatron_tree_cpu<cores>.json.
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from bench_tree_mask import _max_rss_mib, in_subprocess, save, side_by_side, widest_batch  # noqa: E402


def measure(mode: str, turns: int) -> dict:
    """One case in this process: a Megatron trainer, one forward + backward of the widest row."""
    import torch

    from gyre_ray.algo.config import AlgoSection
    from gyre_ray.algo.gspo import make_tree_gspo_loss
    from gyre_ray.model.arch import ModelArgs
    from gyre_ray.model.checkpoint import load_hf, save_hf
    from gyre_ray.model.qwen3 import Qwen3ForCausalLM, init_weights
    from gyre_ray.trainers.config import TrainerSection
    from gyre_ray.trainers.factory import make_trainer

    torch.set_num_threads(1)
    args = ModelArgs.tiny()
    with tempfile.TemporaryDirectory() as tmp:
        folder = save_hf(init_weights(Qwen3ForCausalLM(args), seed=0), args, Path(tmp) / "hf")
        model, args = load_hf(folder)
    section = TrainerSection(backend="megatron", megatron_attention=mode)
    trainer = make_trainer(section, model, args, make_tree_gspo_loss(AlgoSection()))
    batch, calls = widest_batch(turns)
    mask = batch.tensors["loss_mask"]
    current = trainer.compute_logprobs(batch).detach()
    batch.tensors["old_logprobs"] = torch.where(mask, current, torch.zeros_like(current))  # on-policy
    batch.tensors["path_advantages"] = torch.ones_like(batch.tensors["path_advantages"])  # a gradient
    baseline = _max_rss_mib()
    cpu = time.process_time()
    metrics = trainer.forward_backward(batch)
    cpu = time.process_time() - cpu
    peak = _max_rss_mib() - baseline
    grads = trainer.export_grads()
    return {
        "mode": mode,
        "calls": calls,
        "tokens": int(batch.input_ids.size(1)),
        "loss": metrics["loss"],
        "grad_norm": float(torch.linalg.vector_norm(torch.stack([g.norm() for g in grads.values()]))),
        "peak_rss_above_baseline_mib": round(peak, 1),
        "cpu_s": round(cpu, 2),
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--turns", default="3,5", help="main calls per context, one case each")
    parser.add_argument("--child", nargs=2, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.child:
        print(json.dumps(measure(args.child[0], int(args.child[1]))))
        return
    cases = []
    print(f"{'calls':>5} {'T':>7} {'mode':>5} {'peak MiB':>9} {'cpu s':>7} {'grad norm':>12}")
    for turns in (int(t) for t in args.turns.split(",")):
        pair = {mode: in_subprocess(mode, str(turns), script=__file__) for mode in ("dense", "tree")}
        for mode, r in pair.items():
            print(
                f"{r['calls']:>5} {r['tokens']:>7} {mode:>5} {r['peak_rss_above_baseline_mib']:>9.1f} "
                f"{r['cpu_s']:>7.2f} {r['grad_norm']:>12.8g}"
            )
        dense, tree = pair["dense"], pair["tree"]
        cases.append(
            {
                **side_by_side(pair),
                "loss_gap": abs(dense["loss"] - tree["loss"]),
                "grad_norm_relative_gap": abs(dense["grad_norm"] - tree["grad_norm"]) / dense["grad_norm"],
            }
        )
    model = "tiny (ModelArgs.tiny(), float32, 1 thread), Megatron local spec, tensor parallel 1"
    save("megatron_tree", model, cases=cases)


if __name__ == "__main__":
    main()
