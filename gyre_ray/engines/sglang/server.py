"""Start and stop one SGLang server process for a cell, on the GPUs of the cell's bundle.

`launch_command` is the pure part (tested on CPU): `python -m sglang.launch_server` with the model
folder, a free loopback port, tensor parallelism over the bundle's GPUs, `--skip-tokenizer-init`
(the engine speaks token ids only), `--enable-memory-saver` (release/resume around training) and
the configured extras, and `--config FILE`: a YAML file (mode 0600 in a 0700 folder, the job's
alone) holding `api-key`, a random key made for this server (`new_api_key`), so that only the
cell that holds the key may call the server (SGLang then refuses every route but `/health*`,
`/ready*` and `/metrics` without `Authorization: Bearer KEY`). The key is never on the command
line: `/proc/PID/cmdline` is readable by every uid, and SGLang 0.5.23 reads `api_key` from no
environment variable, only from `--api-key` or a `--config` file. `SGLangServer.start` checks first
that sglang is installed and a CUDA GPU is visible and says plainly which is missing; it then waits
for `/health_generate` (bounded by `startup_timeout_s`, failing early with the server's last log
lines, the key blanked out, if the process exits) and removes the key file once the server is up.
`stop` ends the process group it started, nothing else.
"""

from __future__ import annotations

import contextlib
import importlib.util
import json
import os
import secrets
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

# SGLang reports log(softmax(logits / temperature)) unless told otherwise; the loss needs the behaviour
# policy's own log-probs (what the trainer computes, and what the torch engine records). The name
# has been SGLANG_RETURN_ORIGINAL_LOGPROB since 2025 (RETURN_ORIGINAL_LOGPROB before).
ORIGINAL_LOGPROB_ENV = {"SGLANG_RETURN_ORIGINAL_LOGPROB": "1", "RETURN_ORIGINAL_LOGPROB": "1"}


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


# flags the engine sets itself through its key file: one from extra_args would take the server from
# the cell (--api-key, which also wins over the file) or break the key's reach (--admin-api-key: the
# control routes would then want that key instead), and SGLang takes only one --config
_KEY_FLAGS = ("--config", "--api-key", "--admin-api-key")


def new_api_key() -> str:
    """A fresh random key for one server (256 bits). It starts with a letter: SGLang's argument parser
    takes a value that starts with '-' for an option."""
    return "gyre-" + secrets.token_urlsafe(32)


def write_key_config(api_key: str, folder: str | Path) -> Path:
    """`folder/server.yaml` for `sglang.launch_server --config`, holding `api-key`: created new with mode
    0600 (refused if anything is there already); `folder` should be a fresh 0700 one (`tempfile.mkdtemp`)."""
    path = Path(folder) / "server.yaml"
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW, 0o600)
    with os.fdopen(fd, "w") as out:
        out.write(json.dumps({"api-key": api_key}) + "\n")  # JSON is YAML: the key stays one string
    return path


def launch_command(
    model_dir: str,
    port: int,
    options: SGLangOptions,
    gpu_count: int,
    max_running_requests: int,
    radix_cache: bool = True,
    host: str = "127.0.0.1",
    python: str = sys.executable,
    *,
    key_config: str | Path,
) -> list[str]:
    """The `sglang.launch_server` command line for one cell's server; `key_config`: the file from
    `write_key_config` (only its path is on the command line)."""
    tp = options.tp_size or max(1, gpu_count)
    if options.tp_size and gpu_count and options.tp_size > gpu_count:
        raise ValueError(f"engine.sglang.tp_size={options.tp_size} exceeds the bundle's {gpu_count} GPU(s)")
    for arg in options.extra_args:
        flag = arg.split("=", 1)[0]
        # argparse takes an unambiguous prefix of a flag for the flag (`--api-k`, `--conf`)
        if flag.startswith("--") and len(flag) > 2 and any(k.startswith(flag) for k in _KEY_FLAGS):
            raise ValueError(
                f"engine.sglang.extra_args may not hold {flag}: the engine starts the server "
                "with its own random API key (in its own --config file) and the cell alone holds it"
            )
    command = [
        python, "-m", "sglang.launch_server",
        "--model-path", model_dir,
        "--host", host,
        "--port", str(port),
        "--tp-size", str(tp),
        "--mem-fraction-static", str(options.mem_fraction_static),
        "--max-running-requests", str(max_running_requests),
        "--skip-tokenizer-init",
        "--config", str(key_config),
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
        api_key: str | None = None,
        key_file: str | Path | None = None,
    ) -> None:
        """`owned_dirs`: folders made for this server (a saved model, the key file's) that `stop` removes.
        `api_key`: the server's key (blanked out of log lines shown; the health checks go without it);
        `key_file`: the `--config` file holding it, removed once the server is healthy (it has read it)."""
        self.owned_dirs = [Path(d) for d in owned_dirs]
        self.command = command
        self.url = url
        self.api_key = api_key
        self.key_file = Path(key_file) if key_file is not None else None
        self.gpu_ids = [str(g) for g in gpu_ids]
        self.cell_id = cell_id
        self.process: subprocess.Popen | None = None
        self.log_path = Path(tempfile.mkstemp(prefix=f"sglang-{cell_id}-", suffix=".log")[1])

    def start(self) -> None:
        """Start the process (its own process group) with CUDA_VISIBLE_DEVICES = the bundle's GPUs, and
        SGLang told to report each token's log-prob under the policy itself (`ORIGINAL_LOGPROB_ENV`)."""
        env = dict(os.environ, CUDA_VISIBLE_DEVICES=",".join(self.gpu_ids), **ORIGINAL_LOGPROB_ENV)
        with self.log_path.open("wb") as log:
            self.process = subprocess.Popen(
                self.command, stdout=log, stderr=subprocess.STDOUT, env=env, start_new_session=True
            )

    def wait_healthy(self, timeout_s: float, poll_s: float = 1.0) -> None:
        """Poll /health_generate until 200; fail naming the cell if the process dies or time runs out.

        Synchronous on purpose: a cell builds its engine inside its (running) event loop."""
        deadline = time.monotonic() + timeout_s
        # no key: SGLang answers /health* without one, and until the server binds its port another
        # process on the machine could be listening there and would be handed the key
        while time.monotonic() < deadline:
            if self.process is not None and self.process.poll() is not None:
                raise SGLangServerError(
                    f"cell {self.cell_id}: the SGLang server exited with code {self.process.returncode} "
                    f"while starting; last log lines:\n{self.log_tail()}"
                )
            with contextlib.suppress(httpx.HTTPError):
                reply = httpx.get(f"{self.url}/health_generate", timeout=max(poll_s, 5.0))
                if reply.status_code == 200:
                    self._remove_key_file()  # read at start-up, by the launcher, before it serves
                    return
            time.sleep(poll_s)
        self.stop()
        raise SGLangServerError(
            f"cell {self.cell_id}: the SGLang server at {self.url} was not healthy within {timeout_s:.0f} s; "
            f"last log lines:\n{self.log_tail()}"
        )

    def log_tail(self, lines: int = 20) -> str:
        """The log's last lines, with the key blanked out (SGLang logs its server_args at start)."""
        with contextlib.suppress(OSError):
            tail = "\n".join(self.log_path.read_text(errors="replace").splitlines()[-lines:])
            return tail.replace(self.api_key, "<api-key>") if self.api_key else tail
        return "(no log)"

    def _remove_key_file(self) -> None:
        if self.key_file is not None:
            self.key_file.unlink(missing_ok=True)

    def stop(self, grace_s: float = 15.0) -> None:
        """End the server's process group (SIGTERM, then SIGKILL after `grace_s`). Safe to call twice."""
        process, self.process = self.process, None
        self._remove_key_file()
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
