"""SGLang vs the torch engine on one GPU: aggregate decode tokens/s on the same weights (GPU only).

Both engines serve the same small random Qwen3 (saved as an HF folder for SGLang; the torch engine
holds it on cuda:0), `--concurrency` requests of `--prompt-tokens` distinct ids each, greedy,
`--new-tokens` new tokens (no stop ids, so every request runs to its length). Rounds alternate
SGLang / torch and the median is taken, so the ratio compares like with like. Also checks that the
greedy tokens of the first request agree between the two engines.

Usage: python benchmarks/bench_sglang.py [--concurrency 16] [--new-tokens 128] [--rounds 2] [--out DIR]
Saves sglang_gpu.json under DIR (default benchmarks/results). Needs sglang and a CUDA GPU.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import statistics
import tempfile
import time
from pathlib import Path
from typing import Any

import torch

from gyre_ray.engines.base import GenerateRequest, RolloutEngine, SamplingParams
from gyre_ray.engines.config import EngineSection, SGLangOptions
from gyre_ray.engines.sglang import launch_engine
from gyre_ray.engines.testing import small_model, token_prompt
from gyre_ray.engines.torch_engine import TorchEngine
from gyre_ray.model.checkpoint import save_hf


async def decode_round(engine: RolloutEngine, prompts: list[list[int]], new_tokens: int, tag: str) -> tuple:
    sampling = SamplingParams(temperature=0.0, max_new_tokens=new_tokens)
    started = time.perf_counter()
    results = await asyncio.gather(
        *(engine.generate(GenerateRequest(f"{tag}-{i}", p, sampling)) for i, p in enumerate(prompts))
    )
    seconds = time.perf_counter() - started
    return sum(len(r.output_ids) for r in results) / seconds, results[0].output_ids


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--concurrency", type=int, default=16)
    parser.add_argument("--prompt-tokens", type=int, default=64)
    parser.add_argument("--new-tokens", type=int, default=128)
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--out", default="benchmarks/results")
    options = parser.parse_args()
    if not torch.cuda.is_available():
        raise SystemExit("bench_sglang needs a CUDA GPU")
    model = small_model()
    folder = save_hf(model, model.args, tempfile.mkdtemp(prefix="bench-sglang-"))
    section = EngineSection(
        backend="sglang",
        max_batch_size=max(16, options.concurrency),
        sglang=SGLangOptions(mem_fraction_static=0.3, extra_args=["--dtype", "float32"]),
    )
    started = time.perf_counter()
    sglang = launch_engine(
        section, model, model.args, stop_token_ids=[], model_dir=str(folder), gpu_ids=["0"]
    )
    startup_s = time.perf_counter() - started
    torch_engine = TorchEngine(
        model.to("cuda"), model.args, stop_token_ids=[], max_batch_size=section.max_batch_size
    )
    prompts = [token_prompt(options.prompt_tokens, start=3 + i) for i in range(options.concurrency)]
    rates: dict[str, list[float]] = {"sglang": [], "torch": []}
    first: dict[str, list[int]] = {}

    async def run() -> None:
        for index in range(options.rounds + 1):  # round 0 warms both up and is not counted
            for name, engine in (("sglang", sglang), ("torch", torch_engine)):
                rate, tokens = await decode_round(engine, prompts, options.new_tokens, f"{name}{index}")
                first[name] = tokens
                if index:
                    rates[name].append(rate)

    try:
        asyncio.run(run())
    finally:
        sglang.shutdown()
        torch_engine.shutdown()
    median = {name: statistics.median(values) for name, values in rates.items()}
    result: dict[str, Any] = {
        "gpu": torch.cuda.get_device_name(0),
        "model": "tiny random Qwen3 (2 layers, hidden 64, vocab 512), float32",
        "concurrency": options.concurrency,
        "prompt_tokens": options.prompt_tokens,
        "new_tokens": options.new_tokens,
        "rounds": options.rounds,
        "sglang_startup_s": round(startup_s, 1),
        "tokens_per_s": {name: round(value, 1) for name, value in median.items()},
        "rounds_tokens_per_s": rates,
        "sglang_vs_torch": round(median["sglang"] / median["torch"], 3),
        "first_request_tokens_agree": first["sglang"] == first["torch"],
    }
    out = Path(options.out)
    out.mkdir(parents=True, exist_ok=True)
    (out / "sglang_gpu.json").write_text(json.dumps(result, indent=2) + "\n")
    print(json.dumps(result, indent=2))


if __name__ == "__main__":
    main()
