"""A job's runtime starts and stops without error-looking lines from Ray:
- at its start, Ray logs "... has constructor arguments in the object store and max_restarts > 0" for
  an actor that may restart and is given actor handles (the scheduler actor: the workers, the cell
  pool) unless they travel as one opaque argument (`gyre_ray.runtime.scheduler.pack_scheduler_options`);
- at its end, Ray's Serve controller, stopped by `serve.shutdown()`, kills itself while its own
  graceful-shutdown task is pending and the raylet prints "Task ServeController.graceful_shutdown
  failed ... killed by `ray.kill`"; a runtime that started its own Ray leaves Serve to `ray.shutdown()`.
- Serve's driver logger prints INFO lines (its own URL among them, not the proxy's) unless quietened
  after `ray.serve` is imported (the import sets it to INFO).
- Ray warns "Token authentication is enabled for this Ray cluster. Set RAY_AUTH_MODE=disabled to opt
  out" at every start of a local cluster when RAY_AUTH_MODE is unset; the job quietens that logger: the
  auth stays on, the line goes.
One subprocess starts the toy job's runtime on a private Ray and shuts it down."""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
SCRIPT = textwrap.dedent(
    """
    import os
    import sys
    import ray
    from gyre_ray.config import load_config
    from gyre_ray.runtime.cluster import Runtime

    folder = sys.argv[1]
    cfg = load_config("jobs/configs/toy.yaml", [f"proxy.records_dir={folder}/records", "run.max_scheduler_restarts=2"])
    runtime = Runtime.start(cfg, scheduler_options={"run_dir": folder})
    assert runtime.owns_ray
    print("pid", ray.get(runtime.scheduler.pid.remote()), flush=True)
    from ray._private.authentication.authentication_token_setup import AuthenticationTokenLoader
    print("auth", os.environ["RAY_AUTH_MODE"], AuthenticationTokenLoader.instance().has_token(), flush=True)
    runtime.shutdown()
    assert not ray.is_initialized()
    print("stopped", flush=True)
    """
)


@pytest.mark.timeout(400)
def test_a_runtime_on_its_own_ray_starts_and_stops_without_error_lines(tmp_path: Path) -> None:
    env = {k: v for k, v in os.environ.items() if k not in ("RAY_AUTH_MODE", "RAY_ADDRESS")}  # a user's shell
    done = subprocess.run(
        [sys.executable, "-c", SCRIPT, str(tmp_path)],
        cwd=ROOT, env=env, capture_output=True, text=True, timeout=360, check=False,
    )  # fmt: skip
    output = done.stdout + done.stderr
    assert done.returncode == 0, output
    assert "pid " in done.stdout and "stopped" in done.stdout, output
    assert "constructor arguments in the object store" not in output, output
    assert "graceful_shutdown" not in output and "killed by `ray.kill`" not in output, output
    # Serve's own INFO lines (its URL on port 8000 is not the proxy's) stay out of the job's output
    assert "Connecting to existing Serve app" not in output and "is ready at" not in output, output
    assert "auth token True" in done.stdout, output  # token auth on, with a token
    assert "Token authentication is enabled" not in output, output
