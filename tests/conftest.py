"""Fixtures shared by the engine tests: a small random Qwen3 policy and torch engines that always shut down.

A module that needs another model defines its own `model` fixture, which takes precedence.
"""

from __future__ import annotations

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
