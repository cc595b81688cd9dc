"""The training job end to end on the embedded default, on-policy (`scheduler.staleness=0`): local Ray,
two dual-role cells behind the proxy, the scheduler actor, the toy harness, the elastic policy, tree
processing, one GSPO step per RL step on the core, the new weights rolled out by every cell, and the
run's trace.jsonl / costs.json. Weights and gradients move through Mooncake (TCP on loopback) here, so
a job runs end to end on it; the other runtime tests use the default object store. While it runs, the
Ray metrics export port is scraped for every gyre metric."""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest
from metrics_scrape import Scraper

from gyre_ray.config import load_config
from gyre_ray.model.checkpoint import load_hf
from gyre_ray.ports import free_port
from gyre_ray.runtime.report import COST_KEYS
from gyre_ray.train import format_summary, train
from gyre_ray.trajectory.records import read_jsonl
from gyre_ray.transfer.mooncake import mooncake_available

ROOT = Path(__file__).resolve().parents[1]
# Mooncake where it loads (always under CI, where the install must have brought it)
TRANSFER = (
    ["transfer.weights=mooncake", "transfer.gradients=mooncake"]
    if mooncake_available()[0] or os.environ.get("CI") == "true"
    else []
)


SCRAPED: dict[str, Scraper] = {}


@pytest.fixture(scope="module")
def summary(tmp_path_factory: pytest.TempPathFactory) -> dict:
    run_root = tmp_path_factory.mktemp("runs")
    port = free_port()
    cfg = load_config(
        ROOT / "jobs/configs/toy.yaml",
        [
            f"run.run_dir={run_root}",
            "run.steps=2",
            "run.tasks_per_step=1",
            "algo.group_size=3",
            "run.wandb_mode=disabled",
            "scheduler.staleness=0",
            f"run.metrics_export_port={port}",
            *TRANSFER,
        ],
    )
    # Ray exports an actor's gauges every 10 s by default, longer than this run's rollout phases: once a
    # second here (Ray's floor), scraped twice as often, so the gauges' states are seen.
    with pytest.MonkeyPatch.context() as env:
        env.setenv("RAY_metrics_report_interval_ms", "1000")
        with Scraper(port, period_s=0.5) as scraper:
            result = train(cfg)
    SCRAPED["job"] = scraper
    return result


def test_every_step_trains_on_scored_executions(summary: dict) -> None:
    assert len(summary["steps"]) == 2
    version = 0
    for step in summary["steps"]:
        assert step["executions"] == 3 and step["valid"] == 3 and step["timed_out"] == 0
        assert step["calls"] == 3 * 8  # toy harness: 2 main turns, retry pair, 2 sub-agents, summary, 1 turn
        assert step["paths_selected"] <= 5 * 3 < step["paths_total"]  # the budget of 5 bites
        assert step["tokens_packed_selected"] < step["tokens_expanded_all"]
        if step["executions_untrained"] == 3:  # equal rewards: advantage 0, no optimizer step
            assert step["micro_batches"] == 0 and "advantage 0" in step["skipped"]
        else:
            version += 1
            # Every micro-batch was trained (by whichever cells were training then).
            assert sum(step["trained_by_cell"].values()) == step["micro_batches"] > 0
            # Engine behaviour logprobs equal the trainer's recomputation on the same weights.
            assert step["logprob_gap_max"] < 1e-4
        assert step["version"] == version
        assert step["staleness"]["max"] == 0 and step["later_executions_started"] == 0
    # Elastic: a cell switched to training (a trainer may stay one into the next step while the other
    # cell carries that step's executions).
    switches = [e["direction"] for step in summary["steps"] for e in step["switches"]]
    assert switches and switches[0] == "rollout->train"
    # Step 0's task ("vowels") gives graded rewards, so its advantages, and gradient, are non-zero.
    assert summary["steps"][0]["grad_norm"] > 0


def test_cells_generate_with_the_published_weights(summary: dict) -> None:
    records_dir = Path(summary["run_dir"]) / "records"
    step1 = [r for p in sorted(records_dir.glob("s1-*.jsonl")) for r in read_jsonl(p)]
    assert step1, "step 1 recorded no call"
    assert all(set(r.versions) == {1} for r in step1), (
        "step 1 must sample with the weights of step 0's update"
    )
    step0 = [r for p in records_dir.glob("s0-*.jsonl") for r in read_jsonl(p)]
    assert step0 and all(set(r.versions) == {0} for r in step0)
    roles = {r.role for r in step0}
    assert {"main", "sub-agent", "main-summary"} <= roles


def test_run_folder_holds_metrics_summary_and_a_loadable_checkpoint(summary: dict) -> None:
    run_dir = Path(summary["run_dir"])
    rows = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in rows] == [0, 1]
    assert json.loads((run_dir / "summary.json").read_text())["steps"] == summary["steps"]
    model, args = load_hf(summary["checkpoint"])
    assert args.vocab_size > 0 and sum(p.numel() for p in model.parameters()) > 0
    trace = [json.loads(line) for line in (run_dir / "trace.jsonl").read_text().splitlines()]
    assert sorted(r["step"] for r in trace) == [0, 0, 0, 1, 1, 1]
    assert all(
        {"start", "end", "task", "timed_out", "exec_id", "calls", "tokens", "version"} <= set(r)
        for r in trace
    )
    assert all(r["calls"] == 8 and r["tokens"] > 0 and r["version"] == r["step"] for r in trace)
    costs = json.loads((run_dir / "costs.json").read_text())
    assert tuple(costs) == COST_KEYS and costs["cells"] == 2 and costs["makespan_s"] > 0
    assert costs["micro_step_s"] > 0 and costs["train_cell_s_per_execution"] > 0
    text = format_summary(summary)
    assert "2 step(s) done" in text and str(run_dir) in text


def test_ray_metrics_export_every_gyre_metric_with_sane_values(summary: dict) -> None:
    m = SCRAPED["job"]
    assert m.samples > 0, "the metrics port never answered"
    # Gauges are sampled at each export (every second here), so a short run's brief states (a switch)
    # may fall between two exports: those are checked for presence and range; the rollout phase and
    # the running executions last several seconds; counters and histograms are exact.
    # a gauge never scraped reads 0.0 from `value`: the series must have been seen for a 0 to mean 0
    for role in ("rollout", "train", "switching"):
        assert m.seen("ray_gyre_cells", role=role), f"no ray_gyre_cells{{role={role}}} sample"
    for state in ("running", "pending"):
        assert m.seen("ray_gyre_executions", state=state), f"no ray_gyre_executions{{state={state}}} sample"
    assert 1 <= m.value("ray_gyre_cells", role="rollout") <= 2
    assert m.value("ray_gyre_cells", role="train") <= 2 and m.value("ray_gyre_cells", role="switching") <= 2
    assert 1 <= m.value("ray_gyre_executions", state="running") <= 6
    assert m.value("ray_gyre_executions", state="pending") <= 6
    assert "ray_gyre_microbatch_queue_depth" in m.names()
    trained = sum(m.value("ray_gyre_tokens_trained_total", cell=c) for c in ("cell-0", "cell-1"))
    generated = sum(m.value("ray_gyre_tokens_generated_total", cell=c) for c in ("cell-0", "cell-1"))
    assert trained >= sum(s["loss_tokens"] for s in summary["steps"][:1]) > 0
    assert generated > 0
    assert m.value("ray_gyre_policy_version") == summary["steps"][-1]["version"] >= 1
    assert m.value("ray_gyre_staleness_max") == 0  # on-policy run
    assert m.value("ray_gyre_trained_token_staleness_count") >= 1
    assert m.value("ray_gyre_switch_seconds_count", direction="to_train") >= 1
    assert m.value("ray_gyre_proxy_requests_total", api="chat/completions") >= 3 * 8
    assert m.value("ray_gyre_proxy_request_seconds_count", api="chat/completions") >= 3 * 8
