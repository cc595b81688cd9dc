"""Megatron-core trainer vs torch trainer vs transformers on CPU: the figures behind docs/megatron.md.

Runs the cases the tests assert on (`tests/megatron_cases.py`: HF Qwen3 folders with GQA and
head_dim != hidden / heads, tied and untied; tree-packed on-policy GSPO micro-batches from synthetic
agent records) and prints and saves the measured gaps: log-prob max |difference| (Megatron vs torch
on packed trees, Megatron vs transformers on plain rows), gradient max relative error, the first
AdamW update's relative error where the gradient is above float32 rounding, tensor parallel 2 vs 1,
and whether HF -> Megatron -> HF is bit-exact. Timing: forward+backward CPU seconds of one packed
micro-batch set, Megatron / torch, measured side by side (median of rotations).
Results: benchmarks/results/megatron_parity_cpu<cores>.json.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import sys
import tempfile
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "tests"))

from megatron_cases import (  # noqa: E402
    gspo_loss,
    hf_folder,
    max_relative_error,
    packed_batches,
    update_relative_error,
)

from gyre_ray.algo.gspo import step_scale  # noqa: E402
from gyre_ray.model.checkpoint import load_hf, read_hf_weights  # noqa: E402
from gyre_ray.trainers.batch import MicroBatch, sequential_parent_index, token_logprobs  # noqa: E402
from gyre_ray.trainers.config import TrainerSection  # noqa: E402
from gyre_ray.trainers.factory import make_trainer  # noqa: E402

SECTION = dict(lr=1e-2, weight_decay=0.01, grad_clip=1.0)


def _trainers(folder: Path, tp: int = 1) -> tuple:
    model, args = load_hf(folder)
    torch_trainer = make_trainer(TrainerSection(**SECTION), model, args, gspo_loss())
    megatron = make_trainer(
        TrainerSection(backend="megatron", tensor_parallel_size=tp, **SECTION),
        load_hf(folder)[0],
        args,
        gspo_loss(),
    )
    return torch_trainer, megatron


def _transformers_gap(folder: Path, megatron) -> float:
    from transformers import Qwen3ForCausalLM

    ids = torch.randint(1, 256, (2, 19), generator=torch.Generator().manual_seed(3))
    batch = MicroBatch(ids, torch.arange(19).expand(2, 19).clone(), sequential_parent_index(2, 19))
    with torch.no_grad():
        logits = Qwen3ForCausalLM.from_pretrained(folder, dtype=torch.float32).eval()(input_ids=ids).logits
    return float(
        (megatron.compute_logprobs(batch) - token_logprobs(logits, ids, batch.parent_index)).abs().max()
    )


def _one_update(reference, other, batches) -> dict:
    before = reference.state_dict()
    for batch in batches:
        reference.forward_backward(batch)
        other.forward_backward(batch)
    grads = reference.export_grads()
    grad_error = max_relative_error(grads, other.export_grads())
    scale = step_scale(batches)
    norms = reference.optimizer_step(scale)["grad_norm"], other.optimizer_step(scale)["grad_norm"]
    after_ref, after_other = reference.state_dict(), other.state_dict()
    after_ref = {k: v for k, v in after_ref.items() if k in after_other}
    error, covered = update_relative_error(
        {k: before[k] for k in after_ref}, after_ref, after_other, grads, min_grad=1e-3
    )
    return {
        "grad_max_relative_error": grad_error,
        "grad_norms": list(norms),
        "update_relative_error": error,
        "update_gradient_mass_covered": covered,
    }


def _cpu_seconds(trainer, batches) -> float:
    start = time.process_time()
    for batch in batches:
        trainer.forward_backward(batch)
    trainer.zero_grads()
    return time.process_time() - start


def main() -> None:
    argparse.ArgumentParser(description=(__doc__ or "").strip().splitlines()[0]).parse_args()  # --help
    torch.set_num_threads(1)
    results: dict = {
        "host": {"cpus": os.cpu_count(), "python": platform.python_version(), "torch": torch.__version__}
    }
    tmp = Path(tempfile.mkdtemp())
    for tied in (False, True):
        case = "tied" if tied else "untied"
        folder = hf_folder(tmp, tied)
        torch_trainer, megatron = _trainers(folder)
        batches = packed_batches(torch_trainer)
        gaps = [
            float((megatron.compute_logprobs(b) - torch_trainer.compute_logprobs(b)).abs().max())
            for b in batches
        ]
        weights = read_hf_weights(folder)
        out = megatron.state_dict()
        row = {
            "logprob_gap_vs_torch_packed_trees": max(gaps),
            "logprob_gap_vs_transformers": _transformers_gap(folder, megatron),
            "hf_megatron_hf_bit_exact": out.keys() == weights.keys()
            and all(torch.equal(out[k], weights[k]) for k in out),
            "vs_torch": _one_update(torch_trainer, megatron, batches),
        }
        tp1, tp2 = _trainers(folder)[1], None
        try:
            _, tp2 = _trainers(folder, tp=2)
            row["tp2_logprob_gap_vs_tp1"] = max(
                float((tp2.compute_logprobs(b) - tp1.compute_logprobs(b)).abs().max()) for b in batches
            )
            row["tp2_vs_tp1"] = _one_update(tp1, tp2, batches)
        finally:
            if tp2 is not None:
                tp2.close()
        rounds = {"torch": [], "megatron": []}
        for _ in range(3):
            rounds["torch"].append(_cpu_seconds(torch_trainer, batches))
            rounds["megatron"].append(_cpu_seconds(megatron, batches))
        row["fwd_bwd_cpu_s"] = {k: statistics.median(v) for k, v in rounds.items()}
        row["fwd_bwd_ratio_megatron_over_torch"] = (
            row["fwd_bwd_cpu_s"]["megatron"] / row["fwd_bwd_cpu_s"]["torch"]
        )
        results[case] = row
        print(f"{case}: {json.dumps(row, indent=2)}")
    path = ROOT / "benchmarks/results" / f"megatron_parity_cpu{os.cpu_count()}.json"
    path.write_text(json.dumps(results, indent=2) + "\n")
    print(f"saved {path}")


if __name__ == "__main__":
    main()
