"""The KubeRay manifests under deployments/kuberay/ validate strictly against KubeRay's CRDs, and what
they start (the job's entry point and config, the Serve application) is what gyre-ray accepts."""

from __future__ import annotations

import copy
import json
import os
import shlex
from pathlib import Path
from typing import Any

import pytest
import yaml
from kuberay_schema import CRD_DIR, validation_errors

from gyre_ray.config import load_config
from gyre_ray.evaluation import check_tasks_per_step

ROOT = Path(__file__).resolve().parents[1]
MANIFESTS = sorted((ROOT / "deployments" / "kuberay").glob("*.yaml"))

pytestmark = pytest.mark.skipif(
    not CRD_DIR.is_dir() and os.environ.get("CI") != "true",
    reason=f"KubeRay CRD schemas not found at {CRD_DIR} (the shared/ folder beside the repository)",
)


def _load(path: Path) -> dict[str, Any]:
    return yaml.safe_load(path.read_text())


def _by_kind(kind: str) -> dict[str, Any]:
    (manifest,) = [m for m in map(_load, MANIFESTS) if m["kind"] == kind]
    return manifest


def test_manifests_exist_for_training_and_serving() -> None:
    assert {_load(p)["kind"] for p in MANIFESTS} == {"RayJob", "RayService"}


@pytest.mark.parametrize("path", MANIFESTS, ids=lambda p: p.name)
def test_manifest_validates_strictly(path: Path) -> None:
    manifest = _load(path)
    assert manifest["apiVersion"] == "ray.io/v1"
    assert validation_errors(manifest) == []


@pytest.mark.parametrize(
    ("kind", "where", "typo"),
    [
        ("RayJob", ("spec",), "shutdownAfterJobFinish"),
        ("RayJob", ("spec", "rayClusterSpec", "workerGroupSpecs", 0), "replica"),
        ("RayService", ("spec", "rayClusterConfig", "headGroupSpec"), "rayStartParam"),
    ],
)
def test_misspelled_field_fails(kind: str, where: tuple, typo: str) -> None:
    manifest = copy.deepcopy(_by_kind(kind))
    node = manifest
    for key in where:
        node = node[key]
    node[typo] = node.get(typo.rstrip("s") + "s", 1)
    errors = validation_errors(manifest)
    assert any(typo in e for e in errors), errors


def test_wrong_type_fails() -> None:
    manifest = copy.deepcopy(_by_kind("RayJob"))
    manifest["spec"]["rayClusterSpec"]["workerGroupSpecs"][0]["replicas"] = "four"
    errors = validation_errors(manifest)
    # the error is the one planted (the unchanged manifest validates: test_manifest_validates_strictly)
    assert errors == ["spec.rayClusterSpec.workerGroupSpecs.0.replicas: 'four' is not of type 'integer'"]


def test_rayjob_entrypoint_runs_the_job_with_a_valid_config() -> None:
    spec = _by_kind("RayJob")["spec"]
    argv = shlex.split(spec["entrypoint"])
    assert argv[:2] == ["python", "jobs/train.py"]
    assert (ROOT / argv[1]).is_file()
    config_path = argv[argv.index("--config") + 1]
    overrides = argv[argv.index("--config") + 2 :]
    cfg = load_config(ROOT / config_path, overrides)
    assert Path(cfg.run.run_dir).is_absolute(), "runs must outlive the job's temporary working dir"
    runtime_env = yaml.safe_load(spec["runtimeEnvYAML"])
    assert isinstance(runtime_env, dict) and "working_dir" in runtime_env
    mounts = {
        m["mountPath"]
        for m in spec["rayClusterSpec"]["headGroupSpec"]["template"]["spec"]["containers"][0]["volumeMounts"]
    }
    assert any(cfg.run.run_dir.startswith(m) for m in mounts), (cfg.run.run_dir, mounts)
    groups = {g["groupName"]: g for g in spec["rayClusterSpec"]["workerGroupSpecs"]}
    cells = groups["cells"]  # one cell per worker pod: the pod's GPUs are the cell's bundle
    limits = cells["template"]["spec"]["containers"][0]["resources"]["limits"]
    assert int(limits["nvidia.com/gpu"]) == cfg.cells.gpus_per_cell
    assert cells["replicas"] == cfg.cells.num_cells
    _runs_on_the_gpus(cfg)
    check_tasks_per_step(cfg)  # a step's tasks are distinct: the set has enough of them
    agents = groups["agents"]  # one runner actor per agent pod, placed by the pod's custom resource
    assert agents["replicas"] == cfg.agents.runners
    offered = json.loads(json.loads(agents["rayStartParams"]["resources"]))  # KubeRay's quoted JSON string
    assert offered == cfg.agents.runner_resources
    assert "nvidia.com/gpu" not in agents["template"]["spec"]["containers"][0]["resources"]["limits"]
    pod = agents["template"]["spec"]
    local = {v["name"] for v in pod["volumes"] if "emptyDir" in v}  # the workspaces on the pod's own disk
    assert any(
        m["name"] in local and cfg.agents.workspace_root.startswith(m["mountPath"])
        for m in pod["containers"][0]["volumeMounts"]
    ), (cfg.agents.workspace_root, pod["containers"][0]["volumeMounts"])
    assert cfg.proxy.host == "0.0.0.0"  # the agents' pods reach the head's proxy over the network


def test_rayservice_serves_the_proxy_application() -> None:
    from ray.serve.schema import ServeDeploySchema

    serve_config = yaml.safe_load(_by_kind("RayService")["spec"]["serveConfigV2"])
    schema = (
        ServeDeploySchema.model_validate(serve_config)
        if hasattr(ServeDeploySchema, "model_validate")
        else ServeDeploySchema.parse_obj(serve_config)
    )
    (app,) = schema.applications
    module, _, attr = app.import_path.partition(":")
    assert (ROOT / (module.replace(".", "/") + ".py")).is_file()
    assert attr == "app_builder"
    cfg = load_config(ROOT / app.args["config"], app.args["overrides"])
    assert cfg.model.path and Path(cfg.model.path).is_absolute()
    assert cfg.proxy.records_dir.startswith("/mnt/gyre/")  # the volume: the pod's disk goes with it
    spec = _by_kind("RayService")["spec"]["rayClusterConfig"]
    # Serve tooling never runs `serve_proxy`, which gives Serve's HTTP proxy the replica-loss 503:
    # the head container's environment must (the proxy actors run there, proxy_location HeadOnly)
    from gyre_ray.proxy.serve_errors import proxy_env

    head_env = {
        e["name"]: e["value"] for e in spec["headGroupSpec"]["template"]["spec"]["containers"][0]["env"]
    }
    assert head_env == proxy_env(int(head_env.get("GYRE_RETRY_AFTER_S", "0")))
    (cells,) = [g for g in spec["workerGroupSpecs"] if g["groupName"] == "cells"]
    # every cell's bundle must be placed, or the app never starts: a fixed pod per cell
    assert cells["replicas"] == cells["minReplicas"] == cells["maxReplicas"] == cfg.cells.num_cells
    limits = cells["template"]["spec"]["containers"][0]["resources"]["limits"]
    assert int(limits["nvidia.com/gpu"]) == cfg.cells.gpus_per_cell
    _runs_on_the_gpus(cfg)


def _runs_on_the_gpus(cfg) -> None:
    """The GPU backends: the torch engine and trainer would run on the pods' CPUs, the GPUs reserved for nothing."""
    assert cfg.engine.backend == "sglang" and cfg.trainer.backend == "megatron"
    assert cfg.trainer.megatron_ranks <= cfg.cells.gpus_per_cell
