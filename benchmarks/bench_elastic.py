"""Elastic switch benchmark: rollout -> training and training -> rollout of dual-role cells on Ray.

    python benchmarks/bench_elastic.py [--rounds 5] [--inflight 4] [--no-step]

Starts a local Ray, two tiny-model dual-role cells behind the proxy (`start_elastic_proxy`), then per
round switches the satellite and the core through a full round trip, each time with `--inflight`
long generations running on the cell (so the drain exports real KV state):
- rollout -> train = `proxy.drain` (routing stops, in-flight requests exported) + `to_training`
  (engine releases memory, trainer loads the core's weights: one object-store ref for all);
- train -> rollout = `to_rollout` (engine resumes memory, loads the weights) + `proxy.undrain`.
Side by side it times one micro-step (forward/backward on a toy micro-batch) and one weight publish
to a rollout cell, so the switch costs read as ratios on this machine. Finally (unless `--no-step`)
it runs one elastic RL step of the toy harness (2 groups x 3 executions) and reports its switch
events. Results are printed and saved to benchmarks/results/elastic_cpu<cores>.json.
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

ROOT = Path(__file__).resolve().parents[1]
RESULTS = ROOT / "benchmarks" / "results"
sys.path.insert(0, str(ROOT))

from gyre_ray.config import load_config  # noqa: E402
from gyre_ray.engines.base import GenerateRequest, SamplingParams  # noqa: E402

OVERRIDES = [
    "proxy.num_cells=2",
    "proxy.cpus_per_cell=1",
    "proxy.port=0",
    "run.tasks_per_step=2",
    "algo.group_size=3",
    "agents.max_parallel=4",
    "agents.timeout_s=120",
]


def summary(values: list[float]) -> dict[str, float]:
    return {
        "mean_s": round(statistics.fmean(values), 4),
        "p50_s": round(statistics.median(values), 4),
        "max_s": round(max(values), 4),
        "n": len(values),
    }


def toy_micro_batch():
    from gyre_ray.model.arch import ModelArgs
    from gyre_ray.trajectory.pipeline import build_training_batches
    from gyre_ray.trajectory.synthetic import SyntheticWorkload, synthetic_execution

    workload = SyntheticWorkload(system_tokens=64, task_tokens=8, subagent_system_tokens=16, max_subagents=1,
                                 output_tokens=(8, 16), tool_tokens=(8, 16), vocab_size=ModelArgs.tiny().vocab_size)  # fmt: skip
    records = {f"e{i}": synthetic_execution(f"e{i}", i, workload)[0] for i in range(2)}
    return build_training_batches(records, {"e0": 0.0, "e1": 1.0}, dict.fromkeys(records, "g"))[0]


def round_trip(ray, proxy, actor, cell_id: str, weights, version: int, inflight: int, core: bool) -> dict:
    sampling = SamplingParams(temperature=1.0, max_new_tokens=400, stop_token_ids=[])
    streams = [
        actor.generate_all.remote(
            GenerateRequest(f"{cell_id}-{time.time_ns()}-{i}", list(range(50, 114)), sampling)
        )
        for i in range(inflight)
    ]
    time.sleep(0.3 if inflight else 0.0)  # let them decode a little
    t0 = time.perf_counter()
    migrated = proxy.drain(cell_id)
    cell_in = ray.get(actor.to_training.remote(None if core else weights, version), timeout=120)
    t1 = time.perf_counter()
    ray.get(streams, timeout=120)
    t2 = time.perf_counter()
    cell_out = ray.get(actor.to_rollout.remote(weights, version), timeout=120)
    proxy.undrain(cell_id)
    t3 = time.perf_counter()
    return {
        "to_train_s": t1 - t0,
        "to_train_cell_s": cell_in["seconds"],
        "to_rollout_s": t3 - t2,
        "to_rollout_cell_s": cell_out["seconds"],
        "migrated": migrated,
    }


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--inflight", type=int, default=4)
    parser.add_argument("--no-step", action="store_true")
    opts = parser.parse_args()

    import ray
    from ray import serve

    from gyre_ray.agents.launch import plan_step
    from gyre_ray.elastic.launch import start_elastic_proxy
    from gyre_ray.elastic.step import cell_actors, run_elastic_step
    from gyre_ray.envs.base import get_task_set
    from gyre_ray.model.arch import ModelArgs
    from gyre_ray.model.tokenizer import Tokenizer

    tmp = Path(tempfile.mkdtemp(prefix="bench-elastic-"))
    cfg = load_config(ROOT / "jobs/configs/toy.yaml", [*OVERRIDES, f"proxy.records_dir={tmp / 'records'}"])
    ray.init(address="local", num_cpus=2, include_dashboard=False, logging_level="WARNING")
    proxy = start_elastic_proxy(cfg, timeout_s=300)
    try:
        actors = cell_actors(proxy)
        core = actors["cell-0"]
        version = ray.get(core.trainer_version.remote())
        weights = core.state_dict.remote()
        rounds = {"satellite": [], "core": []}
        for _ in range(opts.rounds):
            for name, cell_id in (("satellite", "cell-1"), ("core", "cell-0")):
                rounds[name].append(
                    round_trip(
                        ray, proxy, actors[cell_id], cell_id, weights, version, opts.inflight, name == "core"
                    )
                )
        # side-by-side references: one micro-step on the core, one weight publish to a rollout cell
        batch = ray.put(toy_micro_batch())
        proxy.drain("cell-0")
        ray.get(core.to_training.remote(None, version))
        micro = []
        for _ in range(3):
            t = time.perf_counter()
            ray.get(core.train.remote(batch))
            micro.append(time.perf_counter() - t)
        ray.get(core.to_rollout.remote(weights, version, True))
        proxy.undrain("cell-0")
        publish = []
        for _ in range(3):
            t = time.perf_counter()
            ray.get(actors["cell-1"].update_weights.remote(weights, version))
            publish.append(time.perf_counter() - t)
        report: dict = {
            "hardware": {
                "cpus": os.cpu_count(),
                "machine": platform.machine(),
                "python": platform.python_version(),
            },
            "model": "tiny (float32)",
            "rounds": opts.rounds,
            "inflight_per_switch": opts.inflight,
            "micro_step": summary(micro),
            "weight_publish": summary(publish),
        }
        for name, rows in rounds.items():
            report[name] = {
                "rollout_to_train": summary([r["to_train_s"] for r in rows]),
                "rollout_to_train_cell_only": summary([r["to_train_cell_s"] for r in rows]),
                "train_to_rollout": summary([r["to_rollout_s"] for r in rows]),
                "train_to_rollout_cell_only": summary([r["to_rollout_cell_s"] for r in rows]),
                "requests_migrated_per_switch": statistics.fmean(r["migrated"] for r in rows),
            }
        micro_mean = report["micro_step"]["mean_s"]
        report["ratios_to_micro_step"] = {
            f"{name}_{d}": round(report[name][d]["mean_s"] / micro_mean, 3)
            for name in rounds
            for d in ("rollout_to_train", "train_to_rollout")
        }
        report["reference_paper_s"] = {"rollout_to_train": 8.52, "train_to_rollout": 3.46}
        if not opts.no_step:
            planned = plan_step(
                0, get_task_set(cfg.agents.task_set), cfg.run.tasks_per_step, cfg.algo.group_size
            )
            metrics = run_elastic_step(
                proxy, planned, cfg, tmp / "ws", decode=Tokenizer.default().decode,
                vocab_size=ModelArgs.tiny().vocab_size, timeout_s=600,
            )  # fmt: skip
            keys = (
                "executions",
                "valid",
                "timed_out",
                "micro_batches",
                "trained_by_cell",
                "step_seconds",
                "switches",
            )
            report["elastic_step"] = {k: metrics[k] for k in keys}
    finally:
        proxy.shutdown()
        serve.shutdown()
        ray.shutdown()
    print(json.dumps(report, indent=2))
    RESULTS.mkdir(parents=True, exist_ok=True)
    path = RESULTS / f"elastic_cpu{os.cpu_count()}.json"
    path.write_text(json.dumps(report, indent=2) + "\n")
    print(f"saved {path}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
