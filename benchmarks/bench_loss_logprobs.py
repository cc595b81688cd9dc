"""The trainer's forward + backward scoring every token vs the loss tokens alone, side by side.

The torch trainer scores only the tokens of a micro-batch's `loss_mask` (`model_logprobs(...,
loss_only=True)`): the LM head then runs on the model-generated tokens alone, where an agent's
trajectory is mostly prompt and tool output. This times one training pass (forward, the GSPO loss,
backward) of the same micro-batches both ways, interleaved, on two model shapes:

- `tiny`: the embedded default (`ModelArgs.tiny()`: vocab 8,192, hidden 128, 4 layers);
- `wide-vocab`: Qwen3's vocabulary (151,936) on a small body (hidden 256, 2 layers), where the LM head
  is most of the work, as it is in small models with real tokenizers.

`--backend megatron` times the Megatron-core trainer (tensor parallel 1) instead: every token's
logits through Megatron's output layer and `token_logprobs` (what it did before 2026-12-07) against
its loss-token scoring (`MegatronTrainer._logprobs(batch, loss_only=True)`); it saves
loss_logprobs_megatron_cpu<cores>.json.

Micro-batches come from the synthetic agent workload (`gyre_ray.trajectory.synthetic`, its default
shape) through the real pipeline (trees, selection, packing, micro-batches). Prints the loss-token
share, seconds per pass and the ratio; saves benchmarks/results/loss_logprobs_cpu<cores>.json.

    python benchmarks/bench_loss_logprobs.py [--executions 6] [--repeats 3] [--threads 2] [--backend torch]
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import time
from pathlib import Path

import torch

from gyre_ray.algo.config import AlgoSection
from gyre_ray.algo.gspo import make_tree_gspo_loss
from gyre_ray.model.arch import ModelArgs
from gyre_ray.model.qwen3 import Qwen3ForCausalLM, init_weights
from gyre_ray.trainers.batch import MicroBatch, model_logprobs, token_logprobs
from gyre_ray.trajectory.config import TrajectorySection
from gyre_ray.trajectory.pipeline import build_training_batches
from gyre_ray.trajectory.synthetic import SyntheticWorkload, synthetic_execution

RESULTS = Path(__file__).resolve().parent / "results"
SHAPES = {
    "tiny": ModelArgs.tiny(),
    "wide-vocab": ModelArgs(
        vocab_size=151_936,
        hidden_size=256,
        intermediate_size=768,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=64,
        max_position_embeddings=32_768,
        eos_token_id=0,
    ),  # fmt: skip
}


def micro_batches(executions: int, vocab_size: int) -> list[MicroBatch]:
    workload = SyntheticWorkload(vocab_size=vocab_size)
    records = {f"e{i}": synthetic_execution(f"e{i}", i, workload)[0] for i in range(executions)}
    rewards = {e: float(i) for i, e in enumerate(records)}  # every advantage != 0: all trained
    return build_training_batches(records, rewards, dict.fromkeys(records, "task"), TrajectorySection())


def one_pass(model: Qwen3ForCausalLM, batches: list[MicroBatch], loss_only: bool) -> float:
    loss_fn = make_tree_gspo_loss(AlgoSection())
    started = time.perf_counter()
    for batch in batches:
        loss, _ = loss_fn(model_logprobs(model, batch, loss_only), batch)
        loss.backward()
    model.zero_grad(set_to_none=True)
    return time.perf_counter() - started


class MegatronPass:
    """`one_pass` on the Megatron trainer built from the same weights (tensor parallel 1)."""

    def __init__(self, model: Qwen3ForCausalLM) -> None:
        from gyre_ray.trainers.config import TrainerSection
        from gyre_ray.trainers.factory import make_trainer

        self.loss_fn = make_tree_gspo_loss(AlgoSection())
        self.trainer = make_trainer(TrainerSection(backend="megatron"), model, model.args, self.loss_fn)

    def __call__(self, _model: object, batches: list[MicroBatch], loss_only: bool) -> float:
        trainer = self.trainer
        trainer.model.train()
        started = time.perf_counter()
        for batch in batches:
            if loss_only:
                logprobs = trainer._logprobs(batch, loss_only=True)
            else:  # every token's logits through Megatron's output layer, as before 2026-12-07
                hidden = trainer._hidden(batch.input_ids, batch.position_ids, trainer._attention_mask(batch))
                logits, _ = trainer.model.output_layer(hidden, weight=trainer._output_weight())  # [T, B, V]
                logprobs = token_logprobs(logits.transpose(0, 1), batch.input_ids, batch.parent_index)
            loss, _ = self.loss_fn(logprobs, batch)
            loss.backward()
        trainer.zero_grads()
        return time.perf_counter() - started


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--executions", type=int, default=6)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--backend", choices=("torch", "megatron"), default="torch")
    args = parser.parse_args()
    if args.executions < 2:  # one execution's group advantage is 0: nothing would be trained
        parser.error("--executions must be at least 2 (a group of one has advantage 0: no loss token)")
    torch.set_num_threads(args.threads)
    cases = []
    for name, shape in SHAPES.items():
        batches = micro_batches(args.executions, shape.vocab_size)
        tokens = sum(int(b.tensors["loss_mask"].numel()) for b in batches)
        loss_tokens = sum(int(b.tensors["loss_mask"].sum()) for b in batches)
        model = init_weights(Qwen3ForCausalLM(shape), seed=0, std=0.02).train()
        run = one_pass if args.backend == "torch" else MegatronPass(model)
        run(model, batches[:1], True)  # warm-up
        seconds: dict[str, list[float]] = {"every_token": [], "loss_tokens": []}
        for _ in range(args.repeats):  # interleaved, so drift in the machine's load hits both
            seconds["every_token"].append(run(model, batches, False))
            seconds["loss_tokens"].append(run(model, batches, True))
        best = {k: min(v) for k, v in seconds.items()}
        case = {
            "model": name, "vocab_size": shape.vocab_size, "hidden_size": shape.hidden_size,
            "layers": shape.num_hidden_layers, "micro_batches": len(batches), "padded_tokens": tokens,
            "loss_tokens": loss_tokens, "loss_token_share": round(loss_tokens / tokens, 4),
            "seconds": seconds, "best_s": best,
            "speedup": round(best["every_token"] / best["loss_tokens"], 3),
        }  # fmt: skip
        cases.append(case)
        print(
            f"{name:10s} V={shape.vocab_size:>7,} H={shape.hidden_size} L={shape.num_hidden_layers}: "
            f"{len(batches)} micro-batches, loss tokens {loss_tokens:,}/{tokens:,} ({case['loss_token_share']:.1%}); "
            f"every token {best['every_token']:.2f} s, loss tokens alone {best['loss_tokens']:.2f} s: "
            f"{case['speedup']:.2f}x",
            flush=True,
        )
    backend = "" if args.backend == "torch" else f"{args.backend}_"
    out = RESULTS / f"loss_logprobs_{backend}cpu{os.cpu_count()}.json"
    RESULTS.mkdir(exist_ok=True)
    meta = {"machine": platform.processor() or platform.machine(), "threads": args.threads,
            "executions": args.executions, "repeats": args.repeats, "torch": torch.__version__,
            "backend": args.backend}  # fmt: skip
    out.write_text(json.dumps({"meta": meta, "cases": cases}, indent=1) + "\n")
    print(f"saved {out}")


if __name__ == "__main__":
    main()
