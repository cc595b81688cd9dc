"""Long agent trees cut into pieces (`trajectory.max_piece_tokens`, `gyre_ray.trajectory.pieces`):
the widest row a micro-batch gets, against the tokens the prefix copies add.

    python benchmarks/bench_pieces.py [--calls 50 200 400] [--max-piece-tokens 65536]

Each case is one long synthetic agent execution (`gyre_ray.trajectory.synthetic`): a 20k-token system
prompt, main contexts of about 1.3k tokens a turn compacted every `--turns` turns (about 130k
tokens), two sub-agents; `--calls` sets how many main calls it makes. It goes through the real
pipeline (tree, path selection, packing) and is then cut two ways: into roots only (what every tree
got before `max_piece_tokens`; `max_piece_tokens=0`) and with the limit. Per case: pieces, the
widest piece (the longest row a micro-batch can get: activation memory is linear in it), all
tokens laid out, and the prefix tokens the copies add. Results go to
benchmarks/results/pieces_cpu<cores>.json.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import time
from pathlib import Path

from gyre_ray.trajectory.config import TrajectorySection
from gyre_ray.trajectory.packing import pack_paths
from gyre_ray.trajectory.pieces import split_long
from gyre_ray.trajectory.pipeline import process_execution
from gyre_ray.trajectory.synthetic import SyntheticWorkload, synthetic_execution

RESULTS = Path(__file__).resolve().parent / "results"


def workload(calls: int, turns: int) -> SyntheticWorkload:
    """A main agent of `calls` calls in contexts of `turns` turns, under a 20k-token system prompt."""
    contexts = max(1, round(calls / turns))
    return SyntheticWorkload(
        system_tokens=20_000, segments=(contexts, contexts), turns=(turns, turns), output_tokens=(200, 400),
        tool_tokens=(800, 1_200), max_subagents=2, subagent_turns=(3, 5), subagent_compact_prob=0.0,
        retry_prob=0.05,
    )  # fmt: skip


def measure(calls: int, turns: int, max_piece_tokens: int, seed: int) -> dict:
    started = time.perf_counter()
    records, _ = synthetic_execution("long", seed, workload(calls, turns))
    sample = pack_paths("long", process_execution(records, TrajectorySection()).selected)
    built = time.perf_counter() - started
    out: dict = {"calls": len(records), "tree_tokens": sample.num_tokens, "build_s": round(built, 2)}
    for name, limit in (("roots_only", 0), ("cut", max_piece_tokens)):
        started = time.perf_counter()
        pieces = split_long(sample, limit)
        out[name] = {
            "max_piece_tokens": limit,
            "pieces": len(pieces),
            "widest_piece": max(p.num_tokens for p in pieces),
            "tokens": sum(p.num_tokens for p in pieces),
            "loss_tokens": sum(p.num_loss_tokens for p in pieces),
            "split_s": round(time.perf_counter() - started, 3),
        }
    roots, cut = out["roots_only"], out["cut"]
    out["widest_ratio"] = round(roots["widest_piece"] / cut["widest_piece"], 2)
    out["extra_tokens_share"] = round(cut["tokens"] / roots["tokens"] - 1, 4)
    return out


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--calls", type=int, nargs="+", default=[50, 200, 400], help="main calls per case")
    parser.add_argument("--turns", type=int, default=100, help="main turns per context (then a compaction)")
    parser.add_argument("--max-piece-tokens", type=int, default=TrajectorySection().max_piece_tokens)
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args(argv)
    cases = []
    for calls in args.calls:
        case = measure(calls, args.turns, args.max_piece_tokens, args.seed)
        cases.append(case)
        roots, cut = case["roots_only"], case["cut"]
        print(
            f"{case['calls']:>4} calls, tree {case['tree_tokens']:>8,} tokens: widest row {roots['widest_piece']:>8,}"
            f" -> {cut['widest_piece']:>8,} ({case['widest_ratio']}x narrower), pieces {roots['pieces']} -> "
            f"{cut['pieces']}, tokens +{case['extra_tokens_share']:.1%}, loss tokens {roots['loss_tokens']:,} = "
            f"{cut['loss_tokens']:,}",
            flush=True,
        )
    RESULTS.mkdir(exist_ok=True)
    path = RESULTS / f"pieces_cpu{os.cpu_count()}.json"
    meta = {"date": time.strftime("%Y-%m-%d"), "machine": platform.processor() or platform.machine()}
    path.write_text(json.dumps({**meta, "turns": args.turns, "cases": cases}, indent=2) + "\n")
    print(f"saved {path}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
