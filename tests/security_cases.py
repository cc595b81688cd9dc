"""What the security tests share: the root-only marker (sandboxed runs need root and useradd; under
CI they run), an endpoint no proxy answers, a Python one-liner command and a trivially scored task."""

from __future__ import annotations

import os
import sys

import pytest

from gyre_ray.agents.runner import Endpoint
from gyre_ray.agents.sandbox import can_create_users
from gyre_ray.envs.base import EvalResult, Task

needs_root = pytest.mark.skipif(
    not can_create_users() and os.environ.get("CI") != "true", reason="needs root and useradd"
)
NOWHERE = Endpoint("http://127.0.0.1:9", "key-of-nobody")


def py(code: str) -> list[str]:
    """A command running `code` with this interpreter."""
    return [sys.executable, "-c", code]


def task(prompt: str = "do it", **kw) -> Task:
    """Task "t", scored 0.5 unless `evaluate` says otherwise."""
    return Task("t", prompt, evaluate=kw.pop("evaluate", lambda ws: EvalResult(0.5)), **kw)
