"""gyre-ray's torch engine and trainer side by side with transformers, and both against the roofline.

Both sides load the same HF folder (float32, CPU, 1 torch thread) and see the same tokens. Every
figure is the median of `--repeats` rounds; within a round gyre and transformers alternate
(order flipped each round), so load from other processes on a shared machine hits both alike.
Each timing is taken as wall time and as process CPU time; on a loaded shared machine the CPU
time is the steadier one, so throughput ratios, the trainer and the roofline fractions use it
(wall figures are saved beside them).

- decode: c = 1, 4, 16 concurrent requests of `--prompt` distinct tokens, `--new` greedy tokens each
  (no stop tokens); tokens/s = c * new / wall from submission to the last token. transformers runs
  the c prompts as one `generate` batch (equal lengths: no padding).
- ttft: time to the first token of each of 16 concurrent requests (gyre: mean and max over the
  requests; transformers: the batch's `generate(max_new_tokens=1)`, the same for every request).
- second turn: a `--session`-token prompt, 16 generated tokens, then the next turn (that prompt +
  the reply + 48 new tokens); its time to first token with gyre's prefix cache vs recomputed (gyre
  with the cache off, and transformers).
- trainer: forward + backward on tree-packed micro-batches (the trajectory pipeline's budget-5
  layout of synthetic agent executions): gyre's tree GSPO loss vs transformers' causal-LM loss on
  the same tokens, each packed row as one causal sequence.
- roofline: a measured float32 matmul rate (GFLOP/s) and read bandwidth (GB/s); each figure's
  model FLOPs / s as a fraction of the former and, for decode, its bytes read / s (weights once
  per step + the KV cache) as a fraction of the latter.
- profile (`--parts ...,profile`): CPU ms of one batch-16 decode step and of its weight GEMMs run
  alone (the engine's packed fused copies, and transformers' unfused `F.linear` on the same weights).

Usage: python benchmarks/bench_vs_hf.py [--configs tiny,m61] [--repeats 3] [--parts engine,trainer]
[--out benchmarks/results]. Saves vs_hf_cpu<cores>.json (vs_hf_cpu<cores>_engine.json with
`--parts engine`), with the load average at start and end.
"""

from __future__ import annotations

import argparse
import asyncio
import dataclasses
import json
import os
import platform
import statistics
import tempfile
import time
from pathlib import Path

import torch

from gyre_ray.algo.gspo import tree_gspo_loss
from gyre_ray.engines.base import GenerateRequest, SamplingParams
from gyre_ray.engines.torch_engine import TorchEngine
from gyre_ray.model import native_gemm
from gyre_ray.model.arch import ModelArgs
from gyre_ray.model.checkpoint import load_hf, save_hf
from gyre_ray.model.kv_cache import KVCache
from gyre_ray.model.qwen3 import Qwen3ForCausalLM, init_weights
from gyre_ray.trainers.batch import MicroBatch, model_logprobs
from gyre_ray.trajectory.batching import micro_batches
from gyre_ray.trajectory.config import TrajectorySection
from gyre_ray.trajectory.pieces import split_roots
from gyre_ray.trajectory.pipeline import execution_samples, process_execution
from gyre_ray.trajectory.synthetic import synthetic_executions

LEVELS = (1, 4, 16)


def m61() -> ModelArgs:
    """A ~61M-parameter Qwen3: hidden 768, 8 layers, GQA 12/4, head_dim 64 (the tiny tokenizer's ids)."""
    return dataclasses.replace(
        ModelArgs.tiny(),
        hidden_size=768,
        intermediate_size=2304,
        num_hidden_layers=8,
        num_attention_heads=12,
        num_key_value_heads=4,
        head_dim=64,
    )


CONFIGS = {"tiny": ModelArgs.tiny, "m61": m61}


# ---------------------------------------------------------------------- roofline
def _median_time(fn, repeats: int) -> float:
    """Median process CPU seconds of `fn` (CPU time: other processes' load does not count)."""
    fn()
    times = []
    for _ in range(repeats):
        start = time.process_time()
        fn()
        times.append(time.process_time() - start)
    return statistics.median(times)


def roofline() -> dict[str, float]:
    """The best measured 1,024^3 float32 GEMM rate on one thread (torch's, or gyre's native kernel
    where it is faster) and the read bandwidth of a 128 MiB sum."""
    a, b = torch.randn(1024, 1024), torch.randn(1024, 1024)
    rates = {"torch_matmul_gflops": 2 * 1024**3 / _median_time(lambda: a @ b, 9) / 1e9}
    if native_gemm.library() is not None:
        packed = native_gemm.pack(b.T.contiguous())  # a @ b == a @ (b.T).T
        rates["native_gemm_gflops"] = (
            2 * 1024**3 / _median_time(lambda: native_gemm.gemm(a, packed, 1024), 9) / 1e9
        )
    gflops = max(rates.values())
    x = torch.randn(32 * 1024 * 1024)  # 128 MiB: well past the caches
    read_gbs = x.numel() * 4 / _median_time(x.sum, 7) / 1e9
    return {"matmul_gflops": round(gflops, 2), "read_gbs": round(read_gbs, 2)} | {
        k: round(v, 2) for k, v in rates.items()
    }


def token_flops(args: ModelArgs, context: float) -> float:
    """Forward FLOPs of one token: 2 x matmul weights (LM head included) + attention over `context` keys."""
    h, d = args.hidden_size, args.head_dim
    per_layer = 2 * h * d * (2 * args.num_attention_heads + 2 * args.num_key_value_heads)
    per_layer += 2 * 3 * h * args.intermediate_size + 4 * args.num_attention_heads * d * context
    return args.num_hidden_layers * per_layer + 2 * h * args.vocab_size


def decode_step_bytes(args: ModelArgs, rows: int, context: float) -> float:
    """Bytes one decode step must read: every weight once (float32) + each row's KV cache."""
    kv = 2 * args.num_hidden_layers * args.num_key_value_heads * args.head_dim * 4
    return args.num_parameters * 4 + rows * context * kv


# ---------------------------------------------------------------------- engine side
def prompts(count: int, length: int, salt: int) -> list[list[int]]:
    return [[(31 * i + 7 * j + salt) % 8000 + 10 for j in range(length)] for i in range(count)]


async def gyre_decode(engine: TorchEngine, batch: list[list[int]], new: int, tag: str) -> float:
    params = SamplingParams(temperature=0.0, max_new_tokens=new)
    start = time.perf_counter()
    results = await asyncio.gather(
        *(engine.generate(GenerateRequest(f"{tag}-{i}", p, params)) for i, p in enumerate(batch))
    )
    assert all(len(r.output_ids) == new for r in results)
    return time.perf_counter() - start


async def gyre_ttft(engine: TorchEngine, batch: list[list[int]], tag: str) -> list[float]:
    params = SamplingParams(temperature=0.0, max_new_tokens=1)
    start = time.perf_counter()

    async def first(i: int, p: list[int]) -> float:
        async for _ in engine.stream(GenerateRequest(f"{tag}-{i}", p, params)):
            return time.perf_counter() - start
        raise RuntimeError("no token")

    return list(await asyncio.gather(*(first(i, p) for i, p in enumerate(batch))))


@torch.no_grad()
def hf_generate(model, batch: list[list[int]], new: int) -> float:
    ids = torch.tensor(batch)
    start = time.perf_counter()
    out = model.generate(
        ids,
        attention_mask=torch.ones_like(ids),
        max_new_tokens=new,
        min_new_tokens=new,
        do_sample=False,
        pad_token_id=0,
    )
    assert out.size(1) == ids.size(1) + new
    return time.perf_counter() - start


def engine_round(gyre: TorchEngine, cold: TorchEngine, hf, args: ModelArgs, opts, r: int) -> dict:
    """One round of every engine figure, gyre and transformers alternating."""
    flip = r % 2 == 1
    out: dict[str, float] = {}

    def both(name: str, run_gyre, run_hf) -> None:
        for side, fn in (
            (("hf", run_hf), ("gyre", run_gyre)) if flip else (("gyre", run_gyre), ("hf", run_hf))
        ):
            cpu = time.process_time()
            out[f"{name}_{side}"] = fn()
            out[f"{name}_{side}_cpu"] = time.process_time() - cpu

    for c in LEVELS:
        batch = prompts(c, opts.prompt, 100 * r + c)
        both(
            f"decode{c}",
            lambda b=batch, tag=f"r{r}c{c}": asyncio.run(gyre_decode(gyre, b, opts.new, tag)),
            lambda b=batch: hf_generate(hf, b, opts.new),
        )
    batch = prompts(16, opts.prompt, 100 * r + 50)
    ttfts: list[float] = []

    def run_ttft() -> float:
        ttfts[:] = asyncio.run(gyre_ttft(gyre, batch, f"t{r}"))
        return statistics.mean(ttfts)

    both("ttft16", run_ttft, lambda: hf_generate(hf, batch, 1))
    out["ttft16_gyre_max"] = max(ttfts)
    # Second turn of a session: cached prefix vs recompute.
    first = prompts(1, opts.session, 1000 + r)[0]
    reply = asyncio.run(
        gyre.generate(GenerateRequest(f"s{r}a", first, SamplingParams(0.0, max_new_tokens=16)))
    )
    second = first + reply.output_ids + prompts(1, 48, 2000 + r)[0]
    out["turn2_gyre_cached"] = asyncio.run(gyre_ttft(gyre, [second], f"s{r}b"))[0]
    out["turn2_gyre_recompute"] = asyncio.run(gyre_ttft(cold, [second], f"s{r}c"))[0]
    out["turn2_hf_recompute"] = hf_generate(hf, [second], 1)
    return out


def engine_figures(rounds: list[dict], args: ModelArgs, roof: dict, opts) -> dict:
    med = {k: statistics.median(r[k] for r in rounds) for k in rounds[0]}
    figures: dict[str, dict] = {"median_s": {k: round(v, 4) for k, v in med.items()}}
    context = opts.prompt + opts.new / 2
    for c in LEVELS:
        row = {}
        for side in ("gyre", "hf"):
            row[f"{side}_tokens_per_s"] = round(c * opts.new / med[f"decode{c}_{side}"], 1)
            rate = c * opts.new / med[f"decode{c}_{side}_cpu"]  # per CPU second: the roofline basis
            row[f"{side}_tokens_per_cpu_s"] = round(rate, 1)
            row[f"{side}_compute_fraction"] = round(
                rate * token_flops(args, context) / 1e9 / roof["matmul_gflops"], 3
            )
            bound = c * roof["read_gbs"] * 1e9 / decode_step_bytes(args, c, context)
            row[f"{side}_read_bound_fraction"] = round(rate / bound, 3)
        row["gyre_vs_hf"] = round(row["gyre_tokens_per_s"] / row["hf_tokens_per_s"], 3)
        row["gyre_vs_hf_cpu"] = round(row["gyre_tokens_per_cpu_s"] / row["hf_tokens_per_cpu_s"], 3)
        figures[f"decode_{c}"] = row
    lm_head = 2 * args.hidden_size * args.vocab_size  # a prefill computes logits of its last token only
    prefill_flops = 16 * (opts.prompt * (token_flops(args, opts.prompt / 2) - lm_head) + lm_head)
    figures["ttft_16"] = {
        "gyre_mean_ms": round(1000 * med["ttft16_gyre"], 1),
        "gyre_max_ms": round(1000 * med["ttft16_gyre_max"], 1),
        "hf_ms": round(1000 * med["ttft16_hf"], 1),
        "gyre_mean_vs_hf": round(med["ttft16_gyre"] / med["ttft16_hf"], 3),
        "gyre_cpu_ms": round(1000 * med["ttft16_gyre_cpu"], 1),
        "hf_cpu_ms": round(1000 * med["ttft16_hf_cpu"], 1),
        "gyre_cpu_vs_hf": round(med["ttft16_gyre_cpu"] / med["ttft16_hf_cpu"], 3),
        "gyre_compute_fraction": round(
            prefill_flops / med["ttft16_gyre_cpu"] / 1e9 / roof["matmul_gflops"], 3
        ),
        "hf_compute_fraction": round(prefill_flops / med["ttft16_hf_cpu"] / 1e9 / roof["matmul_gflops"], 3),
    }
    figures["second_turn"] = {
        "session_tokens": opts.session,
        "gyre_cached_ms": round(1000 * med["turn2_gyre_cached"], 1),
        "gyre_recompute_ms": round(1000 * med["turn2_gyre_recompute"], 1),
        "hf_recompute_ms": round(1000 * med["turn2_hf_recompute"], 1),
        "cached_speedup_vs_recompute": round(med["turn2_gyre_recompute"] / med["turn2_gyre_cached"], 2),
    }
    return figures


# ---------------------------------------------------------------------- trainer side
def tree_batches(row_tokens: int, seed: int) -> list[MicroBatch]:
    """The budget-5 tree-packed micro-batch (one row) of synthetic agent executions whose row is
    closest to `row_tokens` tokens."""
    cfg = TrajectorySection(budget=5, row_tokens=row_tokens, micro_batch_tokens=row_tokens)
    samples = []
    for records in synthetic_executions(3, seed).values():
        processed = process_execution(records, cfg)
        for s in execution_samples(processed, 1.0, "packed", False):
            samples.extend(split_roots(s))
    batches = micro_batches(samples, row_tokens, row_tokens, True, cfg.max_row_padding)
    return [min(batches, key=lambda b: abs(b.meta["tokens"] - row_tokens))]


def gyre_train(model: Qwen3ForCausalLM, batches: list[MicroBatch]) -> float:
    model.zero_grad(set_to_none=True)
    start = time.process_time()
    for b in batches:
        loss, _ = tree_gspo_loss(model_logprobs(model, b), b)
        loss.backward()
    return time.process_time() - start


def hf_train(model, batches: list[MicroBatch]) -> float:
    model.zero_grad(set_to_none=True)
    start = time.process_time()
    for b in batches:
        for row, n in enumerate(b.meta["row_lengths"]):
            ids = b.input_ids[row : row + 1, :n]
            model(input_ids=ids, labels=ids).loss.backward()
    return time.process_time() - start


def trainer_figures(
    times: dict[str, list[float]], batches: list[MicroBatch], args: ModelArgs, roof: dict
) -> dict:
    tokens = sum(b.meta["tokens"] for b in batches)
    lengths = [n for b in batches for n in b.meta["row_lengths"]]
    flops = 3 * sum(n * token_flops(args, n / 2) for n in lengths)  # forward + backward ~ 3 forwards
    out: dict[str, float | int | list] = {"tokens": tokens, "row_lengths": lengths}
    for side in ("gyre", "hf"):
        med = statistics.median(times[side])
        out[f"{side}_cpu_s"] = round(med, 3)
        out[f"{side}_tokens_per_s"] = round(tokens / med, 1)
        out[f"{side}_compute_fraction"] = round(flops / med / 1e9 / roof["matmul_gflops"], 3)
        out[f"{side}_all_cpu_s"] = [round(t, 3) for t in times[side]]
    out["gyre_vs_hf"] = round(out["hf_cpu_s"] / out["gyre_cpu_s"], 3)
    return out


# ---------------------------------------------------------------------- decode-step profile
@torch.inference_mode()
def decode_profile(model: Qwen3ForCausalLM, args: ModelArgs, rows: int, prompt: int, steps: int) -> dict:
    """CPU ms of one decode step of `rows` requests after `prompt` tokens, split into its weight GEMMs
    (the same products run alone, packed and as transformers' unfused `F.linear`) and the rest."""
    cache = KVCache()
    ids = torch.tensor(prompts(rows, prompt, 5))
    token = model(ids, kv_cache=cache, logits_to_keep=1)[:, -1].argmax(-1, keepdim=True)

    def step() -> None:
        nonlocal token
        position = torch.full((rows, 1), cache.length)
        token = model(token, position, None, cache)[:, -1].argmax(-1, keepdim=True)

    def projections(fused: bool) -> list[tuple[object, torch.Tensor]]:
        calls = []
        for layer in model.model.layers:
            attn, mlp = layer.self_attn, layer.mlp
            if fused:
                parts = [attn._packed["qkv"], attn._packed["o"], mlp._packed["gate_up"], mlp._packed["down"]]
            else:
                parts = [attn.q_proj, attn.k_proj, attn.v_proj, attn.o_proj, mlp.gate_proj, mlp.up_proj]
                parts.append(mlp.down_proj)
            calls += parts
        calls.append(model._packed["lm_head"] if fused else model.lm_head)
        return [(c, torch.randn(rows, (c.layers[0] if fused else c).weight.size(1))) for c in calls]

    def gemms(calls) -> None:
        for fn, x in calls:
            fn(x)

    packed_calls, plain_calls = projections(True), projections(False)
    step_s = _median_time(lambda: [step() for _ in range(steps)], 3) / steps
    packed_s = _median_time(lambda: gemms(packed_calls), 5)
    plain_s = _median_time(lambda: gemms(plain_calls), 5)
    flops = 2 * rows * sum(c.weight.numel() for c, _ in plain_calls)
    return {
        "rows": rows,
        "packed_kind": packed_calls[0][0].kind,  # native, mkl or onednn (gyre_ray.model.packed_linear)
        "step_ms": round(1000 * step_s, 2),
        "packed_gemm_ms": round(1000 * packed_s, 2),
        "plain_gemm_ms": round(1000 * plain_s, 2),
        "rest_ms": round(1000 * (step_s - packed_s), 2),
        "packed_gemm_gflops": round(flops / packed_s / 1e9, 2),
        "plain_gemm_gflops": round(flops / plain_s / 1e9, 2),
    }


# ---------------------------------------------------------------------- driver
def run_config(name: str, opts, roof: dict) -> dict:
    from transformers import AutoModelForCausalLM

    args = CONFIGS[name]()
    with tempfile.TemporaryDirectory() as folder:
        save_hf(init_weights(Qwen3ForCausalLM(args), seed=0), args, folder)
        gyre_model, _ = load_hf(folder, dtype=torch.float32)
        train_model, _ = load_hf(folder, dtype=torch.float32)
        hf = AutoModelForCausalLM.from_pretrained(
            folder, dtype=torch.float32, attn_implementation="sdpa"
        ).eval()
        hf_train_model = AutoModelForCausalLM.from_pretrained(
            folder, dtype=torch.float32, attn_implementation="sdpa"
        )
    hf_train_model.train()
    engine_kwargs = {"max_batch_size": 16, "stop_token_ids": [], "torch_threads": 1}
    gyre = TorchEngine(gyre_model, args, **engine_kwargs)
    cold = TorchEngine(gyre_model, args, prefix_cache_tokens=0, **engine_kwargs)
    try:
        asyncio.run(gyre_decode(gyre, prompts(4, opts.prompt, 7), 4, "warm"))
        hf_generate(hf, prompts(4, opts.prompt, 7), 4)
        rounds = []
        for r in range(opts.repeats):
            rounds.append(engine_round(gyre, cold, hf, args, opts, r))
            print(
                f"  [{name}] engine round {r + 1}: "
                + ", ".join(f"{k} {v:.3f}" for k, v in rounds[-1].items()),
                flush=True,
            )
    finally:
        gyre.shutdown()
        cold.shutdown()
    result = {
        "model": {**args.to_dict(), "parameters": args.num_parameters},
        "engine": engine_figures(rounds, args, roof, opts),
    }
    if "profile" in opts.parts and getattr(gyre_model, "_packed", None) is not None:
        result["decode_profile"] = decode_profile(gyre_model, args, 16, opts.prompt, 8)
        print(f"  [{name}] decode profile: {result['decode_profile']}", flush=True)
    if "trainer" in opts.parts:
        result["trainer"] = train_side(name, train_model, hf_train_model, args, roof, opts)
    return result


def train_side(name: str, train_model, hf_train_model, args: ModelArgs, roof: dict, opts) -> dict:
    batches = tree_batches(opts.train_tokens[name], seed=0)
    gyre_train(train_model, batches[:1])  # warm-up
    hf_train(hf_train_model, batches[:1])
    times: dict[str, list[float]] = {"gyre": [], "hf": []}
    for r in range(opts.repeats):
        for side in ("hf", "gyre") if r % 2 else ("gyre", "hf"):
            times[side].append(
                gyre_train(train_model, batches) if side == "gyre" else hf_train(hf_train_model, batches)
            )
        print(
            f"  [{name}] trainer round {r + 1}: gyre {times['gyre'][-1]:.2f} s, hf {times['hf'][-1]:.2f} s",
            flush=True,
        )
    return trainer_figures(times, batches, args, roof)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--configs", default="tiny,m61")
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--prompt", type=int, default=64, help="prompt tokens per decode request")
    parser.add_argument("--new", type=int, default=32, help="generated tokens per decode request")
    parser.add_argument("--session", type=int, default=2048, help="first-turn prompt of the session")
    parser.add_argument("--train-tiny", type=int, default=2234, help="packed row tokens, tiny trainer")
    parser.add_argument("--train-m61", type=int, default=1486, help="packed row tokens, 61M trainer")
    parser.add_argument(
        "--parts",
        default="engine,trainer",
        help="engine always runs; 'profile': the batch-16 decode step's GEMM share; without 'trainer' "
        "the trainer side is skipped (file vs_hf_cpu<n>_engine.json)",
    )
    parser.add_argument("--out", default=str(Path(__file__).parent / "results"))
    opts = parser.parse_args(argv)
    opts.parts = set(opts.parts.split(","))
    opts.train_tokens = {"tiny": opts.train_tiny, "m61": opts.train_m61}
    torch.set_num_threads(1)
    import transformers

    roof = roofline()
    print(f"roofline (1 thread): {roof}", flush=True)
    result = {
        "benchmark": "vs_hf",
        "hardware": f"cpu{os.cpu_count()}",
        "platform": platform.platform(),
        "torch": torch.__version__,
        "transformers": transformers.__version__,
        "torch_threads": 1,
        "settings": {k: sorted(v) if isinstance(v, set) else v for k, v in vars(opts).items() if k != "out"},
        "load_average_start": list(os.getloadavg()),
        "roofline": roof,
        "configs": {},
    }
    for name in opts.configs.split(","):
        result["configs"][name] = run_config(name, opts, roof)
        print(
            json.dumps({name: {k: v for k, v in result["configs"][name].items() if k != "model"}}, indent=1)
        )
    result["roofline_after"] = roofline()  # the machine's load can move during the run
    result["load_average_end"] = list(os.getloadavg())
    suffix = "" if "trainer" in opts.parts else "_engine"
    out = Path(opts.out) / f"vs_hf_cpu{os.cpu_count()}{suffix}.json"
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(result, indent=2) + "\n")
    print(f"saved {out}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
