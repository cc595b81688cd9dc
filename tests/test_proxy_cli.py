"""`gyre-ray serve` starts Ray, cells and the proxy, prints one JSON line, serves, and stops on SIGTERM."""

from __future__ import annotations

import json
import os
import selectors
import signal
import subprocess
import sys
import time

import httpx
import openai
import pytest

from gyre_ray.cli import build_parser


def test_serve_is_a_registered_command():
    args = build_parser().parse_args(["serve", "--scripted", "cells.num_cells=3"])
    assert args.handler.__module__ == "gyre_ray.proxy.cli" and args.overrides == ["cells.num_cells=3"]


def _first_json_line(process: subprocess.Popen, timeout_s: float) -> dict:
    selector = selectors.DefaultSelector()
    selector.register(process.stdout, selectors.EVENT_READ)
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if process.poll() is not None:
            raise AssertionError(f"gyre-ray serve exited early with {process.returncode}")
        if selector.select(timeout=1.0):
            line = process.stdout.readline()
            if line.startswith("{"):
                return json.loads(line)
    raise AssertionError("gyre-ray serve printed no JSON line in time")


@pytest.mark.slow
def test_gyre_ray_serve_prints_its_address_serves_and_shuts_down(tmp_path):
    command = [
        sys.executable,
        "-m",
        "gyre_ray.cli",
        "serve",
        "--scripted",
        "cells.num_cells=1",
        "cells.cpus_per_cell=0.5",
        "proxy.port=0",
        f"proxy.records_dir={tmp_path}",
    ]
    env = {**os.environ, "RAY_USAGE_STATS_ENABLED": "0"}
    with open(tmp_path / "serve.log", "w") as log:  # Ray logs a lot: a pipe nobody reads would block it
        process = subprocess.Popen(command, stdout=subprocess.PIPE, stderr=log, text=True, env=env)
        try:
            info = _first_json_line(process, timeout_s=240)
            assert set(info) >= {"base_url", "admin_token", "cells", "records_dir"} and info["cells"] == [
                "cell-0"
            ]
            admin = {"Authorization": f"Bearer {info['admin_token']}"}
            created = httpx.post(info["base_url"] + "/gyre/executions", headers=admin, timeout=60).json()
            client = openai.OpenAI(
                api_key=created["api_key"], base_url=info["openai_base_url"], max_retries=0
            )
            reply = client.chat.completions.create(model="m", messages=[{"role": "user", "content": "hi"}])
            assert reply.choices[0].message.content
            process.send_signal(signal.SIGTERM)
            assert process.wait(timeout=120) == 0
        finally:
            if process.poll() is None:
                process.kill()
                process.wait(timeout=30)
