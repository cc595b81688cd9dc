"""Fixtures shared by the engine tests: a small random Qwen3 policy and torch engines that always shut down.

A module that needs another model defines its own `model` fixture, which takes precedence.
"""

from __future__ import annotations

import contextlib
import shutil
import tempfile
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest

from gyre_ray.engines.testing import small_engine, small_model
from gyre_ray.engines.torch_engine import TorchEngine
from gyre_ray.model.qwen3 import Qwen3ForCausalLM


@pytest.fixture
def model() -> Qwen3ForCausalLM:
    """`gyre_ray.engines.testing.small_model()`: two layers, vocab 512, wide init, eos id 0."""
    return small_model()


@pytest.fixture
def new_engine() -> Iterator[Callable[..., TorchEngine]]:
    """`new_engine(model=None, **options)` -> `small_engine(...)`, shut down when the test ends
    (also when it fails, so no engine thread outlives its test)."""
    made: list[TorchEngine] = []

    def make(model: Qwen3ForCausalLM | None = None, **options: Any) -> TorchEngine:
        engine = small_engine(model, **options)
        made.append(engine)
        return engine

    yield make
    for engine in made:
        engine.shutdown()


@pytest.fixture
def exec_tmp() -> Iterator[Path]:
    """A folder for sandboxed executions, outside pytest's basetemp: each pytest session run as root
    closes `/tmp/pytest-of-root` to its owner again, which would lock sandbox users out mid-test."""
    path = Path(tempfile.mkdtemp(prefix="gyre-exec-test-"))
    yield path
    shutil.rmtree(path, ignore_errors=True)


def _stop_leftover_ray() -> None:
    """Shut down a Ray (and its Serve) this process still has: one a module left behind, or one Ray
    started by itself on a first `ray.put` / `ray.get` outside any fixture."""
    import sys

    if "ray" not in sys.modules:
        return
    import ray

    if ray.is_initialized():
        from ray import serve

        with contextlib.suppress(Exception):
            serve.shutdown()
        ray.shutdown()


@pytest.fixture(scope="module", autouse=True)
def no_ray_across_modules() -> Iterator[None]:
    """Each test module starts with no Ray in this process and leaves none behind (under pytest-xdist
    one worker runs many modules in turn; a leftover Ray would make the next module's `ray.init` fail
    and its jobs run without their own options)."""
    _stop_leftover_ray()
    yield
    _stop_leftover_ray()


# The modules that take minutes (measured: `--durations`, junit per-module sums), longest first. `make
# test` hands whole modules to its workers in collection order (`--dist loadfile --no-loadscope-reorder`):
# started first, these no longer trail the run on one worker while the other sits idle (xdist's default
# reorder puts modules with many tests first, and these have few).
HEAVY_FIRST = (
    "test_faults_driver.py", "test_faults_cells.py", "test_resume_job.py",
    "test_agents_job.py", "test_megatron_job.py", "test_runtime_ray.py", "test_faults_core.py",
    "test_train_job.py", "test_faults_control.py", "test_transfer.py", "test_faults_nodes.py",
    "test_transfer_job.py", "test_faults_proxy.py",
)  # fmt: skip


def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    """Run the `HEAVY_FIRST` modules first, in that order; every other test keeps its place after them."""
    rank = {name: i for i, name in enumerate(HEAVY_FIRST)}
    items.sort(key=lambda item: rank.get(item.path.name, len(rank)))
