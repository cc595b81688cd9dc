"""Start and stop one SGLang server process for a cell, on the GPUs of the cell's bundle.

`launch_command` is the pure part (tested on CPU): `python -m sglang.launch_server` with the model
folder, a free loopback port, tensor parallelism over the bundle's GPUs, `--skip-tokenizer-init`
(the engine speaks token ids only), `--enable-memory-saver` (release/resume around training) and
the configured extras. `SGLangServer.start` checks first that sglang is installed and a CUDA GPU
is visible and says plainly which is missing; it then waits for `/health_generate` (bounded by
`startup_timeout_s`, failing early with the server's last log lines if the process exits).
`stop` ends the process group it started, nothing else.
"""

from __future__ import annotations

import contextlib
import importlib.util
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from collections.abc import Sequence
from pathlib import Path

import httpx

from gyre_ray.engines.config import SGLangOptions
from gyre_ray.engines.sglang.client import SGLangServerError


class SGLangUnavailableError(NotImplementedError):
    """SGLang cannot run here: the package is missing or no CUDA GPU is visible (what `gyre-ray generate`
    and other callers of `make_engine` report as a backend this machine lacks)."""


def check_available(cell_id: str, gpu_ids: Sequence[int | str]) -> None:
    """Raise SGLangUnavailableError saying what is missing (sglang, a GPU) for `cell_id`."""
    if importlib.util.find_spec("sglang") is None:
        raise SGLangUnavailableError(
            f"cell {cell_id}: engine.backend=sglang needs the sglang package (pip install 'sglang[all]'; "
            "it has no CPU build) and a CUDA GPU; use engine.backend=torch on CPU machines, or set "
            "engine.sglang.url to a running server"
        )
    if not gpu_ids:
        raise SGLangUnavailableError(
            f"cell {cell_id}: engine.backend=sglang needs a CUDA GPU but the cell's bundle has none "
            "(set cells.gpus_per_cell >= 1), or set engine.sglang.url to a running server"
        )


def launch_command(
    model_dir: str,
    port: int,
    options: SGLangOptions,
    gpu_count: int,
    max_running_requests: int,
    radix_cache: bool = True,
    host: str = "127.0.0.1",
    python: str = sys.executable,
) -> list[str]:
    """The `sglang.launch_server` command line for one cell's server."""
    tp = options.tp_size or max(1, gpu_count)
    if options.tp_size and gpu_count and options.tp_size > gpu_count:
        raise ValueError(f"engine.sglang.tp_size={options.tp_size} exceeds the bundle's {gpu_count} GPU(s)")
    command = [
        python, "-m", "sglang.launch_server",
        "--model-path", model_dir,
        "--host", host,
        "--port", str(port),
        "--tp-size", str(tp),
        "--mem-fraction-static", str(options.mem_fraction_static),
        "--max-running-requests", str(max_running_requests),
        "--skip-tokenizer-init",
    ]  # fmt: skip
    if options.memory_saver:
        command.append("--enable-memory-saver")
    if not radix_cache:
        command.append("--disable-radix-cache")
    return command + list(options.extra_args)


class SGLangServer:
    """One `sglang.launch_server` process owned by a cell."""

    def __init__(
        self,
        command: list[str],
        url: str,
        gpu_ids: Sequence[int | str],
        cell_id: str,
        owned_dirs: Sequence[str | Path] = (),
    ) -> None:
        """`owned_dirs`: folders made for this server (a saved model) that `stop` removes."""
        self.owned_dirs = [Path(d) for d in owned_dirs]
        self.command = command
        self.url = url
        self.gpu_ids = [str(g) for g in gpu_ids]
        self.cell_id = cell_id
        self.process: subprocess.Popen | None = None
        self.log_path = Path(tempfile.mkstemp(prefix=f"sglang-{cell_id}-", suffix=".log")[1])

    def start(self) -> None:
        """Start the process (its own process group) with CUDA_VISIBLE_DEVICES = the bundle's GPUs."""
        env = dict(os.environ, CUDA_VISIBLE_DEVICES=",".join(self.gpu_ids))
        with self.log_path.open("wb") as log:
            self.process = subprocess.Popen(
                self.command, stdout=log, stderr=subprocess.STDOUT, env=env, start_new_session=True
            )

    def wait_healthy(self, timeout_s: float, poll_s: float = 1.0) -> None:
        """Poll /health_generate until 200; fail naming the cell if the process dies or time runs out.

        Synchronous on purpose: a cell builds its engine inside its (running) event loop."""
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            if self.process is not None and self.process.poll() is not None:
                raise SGLangServerError(
                    f"cell {self.cell_id}: the SGLang server exited with code {self.process.returncode} "
                    f"while starting; last log lines:\n{self.log_tail()}"
                )
            with contextlib.suppress(httpx.HTTPError):
                if httpx.get(f"{self.url}/health_generate", timeout=max(poll_s, 5.0)).status_code == 200:
                    return
            time.sleep(poll_s)
        self.stop()
        raise SGLangServerError(
            f"cell {self.cell_id}: the SGLang server at {self.url} was not healthy within {timeout_s:.0f} s; "
            f"last log lines:\n{self.log_tail()}"
        )

    def log_tail(self, lines: int = 20) -> str:
        with contextlib.suppress(OSError):
            return "\n".join(self.log_path.read_text(errors="replace").splitlines()[-lines:])
        return "(no log)"

    def stop(self, grace_s: float = 15.0) -> None:
        """End the server's process group (SIGTERM, then SIGKILL after `grace_s`). Safe to call twice."""
        process, self.process = self.process, None
        for folder in self.owned_dirs:
            shutil.rmtree(folder, ignore_errors=True)
        if process is None or process.poll() is not None:
            return
        with contextlib.suppress(ProcessLookupError):
            os.killpg(process.pid, signal.SIGTERM)
        try:
            process.wait(grace_s)
        except subprocess.TimeoutExpired:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(process.pid, signal.SIGKILL)
            process.wait(5)
