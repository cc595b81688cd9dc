"""Dual-role cells as Ray actors behind the Serve proxy: a switch round trip, then one elastic RL step.

One local Ray + Serve for the module, two tiny-model cells (engine + trainer replica each). Proves:
rollout -> training -> rollout keeps the proxy serving (the other cell takes the calls), the switched
cell serves again afterwards and its tokens carry the new version, with the same weights as the
other cell; then a whole elastic step with the toy harness on both cells, in which a cell switches to
training while executions are still running, no execution fails, and every cell ends on the new version.
"""

from __future__ import annotations

import time
from pathlib import Path

import openai
import pytest

ray = pytest.importorskip("ray")

from gyre_ray.agents.launch import plan_step  # noqa: E402
from gyre_ray.cells.cell import TokenBatch  # noqa: E402
from gyre_ray.config import load_config  # noqa: E402
from gyre_ray.elastic.launch import start_elastic_proxy  # noqa: E402
from gyre_ray.elastic.step import cell_actors, run_elastic_step  # noqa: E402
from gyre_ray.engines.base import GenerateRequest, SamplingParams  # noqa: E402
from gyre_ray.envs.base import get_task_set  # noqa: E402
from gyre_ray.model.arch import ModelArgs  # noqa: E402
from gyre_ray.model.tokenizer import Tokenizer  # noqa: E402
from gyre_ray.trajectory.pipeline import build_training_batches  # noqa: E402
from gyre_ray.trajectory.records import read_jsonl  # noqa: E402
from gyre_ray.trajectory.synthetic import SyntheticWorkload, synthetic_execution  # noqa: E402

OVERRIDES = [
    "proxy.num_cells=2",
    "proxy.cpus_per_cell=1",
    "proxy.port=0",
    "run.tasks_per_step=2",
    "algo.group_size=3",
    "agents.max_parallel=4",  # 2 executions per cell: the second group waits for room
    "agents.timeout_s=120",
    "trainer.lr=1e-3",
]


@pytest.fixture(scope="module")
def served(tmp_path_factory):
    from ray import serve

    ray.init(address="local", num_cpus=2, include_dashboard=False, logging_level="WARNING")
    records = tmp_path_factory.mktemp("records")
    cfg = load_config("jobs/configs/toy.yaml", [*OVERRIDES, f"proxy.records_dir={records}"])
    handle = start_elastic_proxy(cfg, timeout_s=180)
    yield cfg, handle
    handle.shutdown()
    serve.shutdown()
    ray.shutdown()


def _greedy(actor, rid: str) -> tuple[list[int], list[float], set[int]]:
    sampling = SamplingParams(temperature=0.0, max_new_tokens=6, stop_token_ids=[])
    events = ray.get(
        actor.generate_all.remote(GenerateRequest(rid, list(range(100, 130)), sampling)), timeout=60
    )
    tokens = [e for batch in events if isinstance(batch, TokenBatch) for e in batch.events if e.token_id >= 0]
    return [e.token_id for e in tokens], [e.logprob for e in tokens], {e.version for e in tokens}


def _micro_batches():
    workload = SyntheticWorkload(system_tokens=12, task_tokens=4, subagent_system_tokens=6, tool_tokens=(2, 5),
                                 output_tokens=(2, 5), summary_tokens=4, turns=(2, 3), max_subagents=1,
                                 vocab_size=ModelArgs.tiny().vocab_size)  # fmt: skip
    records = {f"e{i}": synthetic_execution(f"e{i}", i, workload)[0] for i in range(3)}
    return build_training_batches(records, {"e0": 0.0, "e1": 1.0, "e2": 2.0}, dict.fromkeys(records, "g"))


def test_switch_round_trip_keeps_serving_and_new_tokens_carry_the_new_version(served) -> None:
    cfg, proxy = served
    actors = cell_actors(proxy)
    core, satellite = actors["cell-0"], actors["cell-1"]
    before = _greedy(core, "before")
    assert before[2] == {0}

    started = time.perf_counter()
    proxy.drain("cell-0")
    ray.get(core.to_training.remote(None, 0), timeout=60)
    to_train_s = time.perf_counter() - started
    status = ray.get(core.status.remote())
    assert status["role"] == "train" and status["engine"]["released"]

    # While cell-0 trains, agents keep being served (by cell-1).
    key = proxy.register_execution()
    client = openai.OpenAI(base_url=proxy.openai_base_url, api_key=key["api_key"])
    client.chat.completions.create(model="m", messages=[{"role": "user", "content": "hi"}], max_tokens=4)
    assert [r.meta["cells"] for r in proxy.records(key["execution_id"])] == [["cell-1"]]

    for batch in _micro_batches():
        ray.get(core.train.remote(ray.put(batch)), timeout=60)
    step = ray.get(core.optimizer_step.remote(1.0), timeout=60)
    assert step["version"] == 1 and step["grad_norm"] > 0
    weights = core.state_dict.remote()  # one object: the core's engine and the satellite both load it
    started = time.perf_counter()
    ray.get(core.to_rollout.remote(weights, 1), timeout=60)
    proxy.undrain("cell-0")
    to_rollout_s = time.perf_counter() - started
    ray.get(satellite.update_weights.remote(weights, 1), timeout=60)

    after = _greedy(core, "after")
    assert after[2] == {1}, "tokens after the round trip must carry the new version"
    assert after[1] != before[1], "the engine must serve the updated weights"
    same = _greedy(satellite, "same")
    assert same[0] == after[0] and same[1] == pytest.approx(after[1], abs=1e-5)
    assert all(c["routable"] and c["role"] == "rollout" for c in proxy.cells())
    print(f"switch round trip: rollout->train {to_train_s:.3f} s, train->rollout {to_rollout_s:.3f} s")


def test_elastic_step_switches_a_cell_while_executions_run_and_none_fails(served, tmp_path) -> None:
    cfg, proxy = served
    actors = cell_actors(proxy)
    start_version = ray.get(actors["cell-0"].trainer_version.remote())
    planned = plan_step(0, get_task_set(cfg.agents.task_set), cfg.run.tasks_per_step, cfg.algo.group_size)
    tokenizer = Tokenizer.default()
    metrics = run_elastic_step(
        proxy, planned, cfg, tmp_path / "ws", decode=tokenizer.decode, vocab_size=ModelArgs.tiny().vocab_size,
        timeout_s=300,
    )  # fmt: skip
    print({k: metrics[k] for k in ("step_seconds", "trained_by_cell", "costs", "switches")})
    assert metrics["executions"] == 6 and metrics["valid"] == 6 and metrics["timed_out"] == 0
    to_train = [e for e in metrics["switches"] if e["direction"] == "rollout->train"]
    assert any(e["executions_running"] > 0 for e in to_train), metrics["switches"]
    assert (
        metrics["micro_batches"] > 0 and sum(metrics["trained_by_cell"].values()) == metrics["micro_batches"]
    )
    assert metrics["version"] == start_version + 1 and metrics["grad_norm"] > 0
    for cell in proxy.cells():
        assert cell["role"] == "rollout" and cell["routable"]
        assert cell["engine"]["version"] == start_version + 1
    spilled = [
        r for item in planned for r in read_jsonl(Path(proxy.records_dir) / f"{item.execution_id}.jsonl")
    ]
    assert len(spilled) == metrics["calls"]
    assert all(set(r.versions) == {start_version} for r in spilled), (
        "on-policy: the step's start version only"
    )
