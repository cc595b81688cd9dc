"""Torch rollout engine figures: aggregate decode throughput by concurrency, and prefix-cache reuse.

1. Throughput: c concurrent requests (c = 1, 4, 16), each a distinct prompt and a fixed number of
   new tokens (no stop tokens, so every request runs to its length). Aggregate tokens/s is all
   generated tokens over the wall time from submission to the last token. The levels are measured
   interleaved over several rounds and the median taken, so the ratios compare like with like.
   Measured with 1 torch thread (what Ray gives a 1-CPU actor) and with torch's default.
   Target: 16 concurrent >= 4x the single-request rate.
2. Prefix reuse: a 20-turn chat session rendered with the model's ChatML template, each turn's
   prompt = the previous prompt + the model's recorded output + a new user message (token-in /
   token-out). Reuse = prompt tokens served from the prefix cache / all prompt tokens.
   Target: >= 90%.

Usage: python benchmarks/bench_engine.py [--new-tokens 96] [--rounds 3] [--out benchmarks/results]
Saves engine_cpu<cores>.json (or engine_<gpu>.json) under the output folder.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import platform
import statistics
import time
from pathlib import Path

import torch

from gyre_ray.engines.base import GenerateRequest, SamplingParams
from gyre_ray.engines.torch_engine import TorchEngine
from gyre_ray.model.arch import ModelArgs
from gyre_ray.model.chat_template import encode_chat
from gyre_ray.model.qwen3 import Qwen3ForCausalLM, init_weights
from gyre_ray.model.tokenizer import Tokenizer

LEVELS = (1, 4, 16)


def hardware_tag() -> str:
    if torch.cuda.is_available():
        return torch.cuda.get_device_name(0).lower().replace(" ", "-")
    return f"cpu{os.cpu_count()}"


async def throughput_once(
    engine: TorchEngine, concurrency: int, prompt_len: int, new_tokens: int, tag: str
) -> float:
    params = SamplingParams(temperature=1.0, max_new_tokens=new_tokens, seed=0)
    requests = [
        GenerateRequest(f"{tag}-{i}", [(17 * i + 5 * j) % 8000 + 10 for j in range(prompt_len)], params)
        for i in range(concurrency)
    ]
    start = time.perf_counter()
    results = await asyncio.gather(*(engine.generate(r) for r in requests))
    elapsed = time.perf_counter() - start
    assert all(len(r.output_ids) == new_tokens for r in results)
    return concurrency * new_tokens / elapsed


async def measure_throughput(engine: TorchEngine, rounds: int, prompt_len: int, new_tokens: int) -> dict:
    await throughput_once(engine, 4, prompt_len, 8, "warmup")
    rates: dict[int, list[float]] = {c: [] for c in LEVELS}
    for r in range(rounds):
        for c in LEVELS:
            rates[c].append(await throughput_once(engine, c, prompt_len, new_tokens, f"r{r}c{c}"))
    median = {c: statistics.median(v) for c, v in rates.items()}
    return {
        "tokens_per_s": {str(c): round(median[c], 1) for c in LEVELS},
        "all_rounds": {str(c): [round(x, 1) for x in v] for c, v in rates.items()},
        "speedup_vs_1": {str(c): round(median[c] / median[1], 2) for c in LEVELS},
    }


async def measure_reuse(engine: TorchEngine, tokenizer: Tokenizer, turns: int, reply_tokens: int) -> dict:
    messages = [{"role": "system", "content": "You are a careful coding agent. " * 20}]
    recorded: dict[int, list[int]] = {}
    per_turn = []
    for turn in range(turns):
        messages.append(
            {"role": "user", "content": f"Step {turn}: run the tests again and report what failed."}
        )
        prompt = encode_chat(tokenizer, messages, assistant_tokens=recorded)
        before = engine.stats()
        params = SamplingParams(temperature=1.0, max_new_tokens=reply_tokens, seed=turn)
        result = await engine.generate(GenerateRequest(f"turn{turn}", prompt, params))
        after = engine.stats()
        per_turn.append(
            {
                "prompt_tokens": len(prompt),
                "cached": after["prefix_cached_tokens"] - before["prefix_cached_tokens"],
                "computed": after["prefill_computed_tokens"] - before["prefill_computed_tokens"],
            }
        )
        recorded[len(messages)] = result.output_ids
        messages.append(
            {"role": "assistant", "content": tokenizer.decode(result.output_ids, skip_special_tokens=True)}
        )
    prompt_total = sum(t["prompt_tokens"] for t in per_turn)
    cached_total = sum(t["cached"] for t in per_turn)
    return {
        "turns": turns,
        "prompt_tokens": prompt_total,
        "cached_tokens": cached_total,
        "computed_tokens": sum(t["computed"] for t in per_turn),
        "reuse_ratio": round(cached_total / prompt_total, 4),
        "reuse_ratio_after_first_turn": round(
            cached_total / (prompt_total - per_turn[0]["prompt_tokens"]), 4
        ),
        "per_turn": per_turn,
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--new-tokens", type=int, default=96)
    parser.add_argument("--prompt-tokens", type=int, default=64)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--turns", type=int, default=20)
    parser.add_argument("--out", default=str(Path(__file__).parent / "results"))
    opts = parser.parse_args()

    args = ModelArgs.tiny()
    model = init_weights(Qwen3ForCausalLM(args), seed=0).eval()
    tokenizer = Tokenizer.default()
    default_threads = torch.get_num_threads()
    throughput = {}
    for threads in sorted({1, default_threads}):
        engine = TorchEngine(
            model, args, max_batch_size=16, prefix_cache_tokens=0, stop_token_ids=[], torch_threads=threads
        )
        throughput[f"threads_{threads}"] = asyncio.run(
            measure_throughput(engine, opts.rounds, opts.prompt_tokens, opts.new_tokens)
        )
        engine.shutdown()
    torch.set_num_threads(default_threads)
    session_engine = TorchEngine(
        model, args, prefix_cache_tokens=262_144, stop_token_ids=tokenizer.stop_ids()
    )
    reuse = asyncio.run(measure_reuse(session_engine, tokenizer, opts.turns, reply_tokens=48))
    session_engine.shutdown()

    report = {
        "benchmark": "engine",
        "hardware": hardware_tag(),
        "torch": torch.__version__,
        "default_torch_threads": default_threads,
        "python": platform.python_version(),
        "model": {"preset": "tiny", "parameters": args.num_parameters},
        "settings": {
            "prompt_tokens": opts.prompt_tokens,
            "new_tokens": opts.new_tokens,
            "rounds": opts.rounds,
        },
        "throughput": throughput,
        "prefix_reuse": reuse,
        "targets": {
            "speedup_16_vs_1": {
                "target": 4.0,
                "measured": {k: v["speedup_vs_1"]["16"] for k, v in throughput.items()},
            },
            "reuse_ratio": {"target": 0.9, "measured": reuse["reuse_ratio"]},
        },
    }
    out = Path(opts.out)
    out.mkdir(parents=True, exist_ok=True)
    path = out / f"engine_{hardware_tag()}.json"
    path.write_text(json.dumps(report, indent=2) + "\n")
    for key, figures in throughput.items():
        tps = figures["tokens_per_s"]
        print(
            f"[torch {key}] aggregate decode tokens/s: 1 -> {tps['1']}, 4 -> {tps['4']}, 16 -> {tps['16']}; "
            f"16 concurrent / 1 = {figures['speedup_vs_1']['16']}x (target >= 4x)"
        )
    print(
        f"prefix reuse over {reuse['turns']} turns: {reuse['reuse_ratio']:.1%} of "
        f"{reuse['prompt_tokens']} prompt tokens (target >= 90%)"
    )
    print(f"saved {path}")


if __name__ == "__main__":
    main()
