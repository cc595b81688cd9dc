"""Security: a sandboxed agent cannot reach a cell's rollout engine past the proxy (the SGLang server
asks for a key the agent does not have)."""

from __future__ import annotations

from pathlib import Path

import pytest
from security_cases import NOWHERE, needs_root, py
from security_cases import task as make_task

from gyre_ray.agents.runner import run_execution

# ---- the rollout engine wants a key only its cell holds --------------------------------------------

SCAN_AND_ABORT = r"""
import urllib.request
from concurrent.futures import ThreadPoolExecutor
ports = []
for line in open("/proc/net/tcp").read().splitlines()[1:]:
    f = line.split()
    if f[3] == "0A" and f[1].startswith("0100007F:"):  # LISTEN on 127.0.0.1
        ports.append(int(f[1].split(":")[1], 16))

def attack(port):  # all at once: a busy machine has many listeners, some of which never answer HTTP
    try:
        info = urllib.request.urlopen(f"http://127.0.0.1:{port}/get_server_info", timeout=3).read()
    except Exception:
        return None
    if b"weight_version" in info:  # an SGLang server: abort every request of every execution
        req = urllib.request.Request(f"http://127.0.0.1:{port}/abort_request", data=b'{"abort_all": true}',
                                     headers={"Content-Type": "application/json"})
        return (port, urllib.request.urlopen(req, timeout=5).status)

with ThreadPoolExecutor(32) as pool:
    hits = [hit for hit in pool.map(attack, ports) if hit]
print("SCANNED", len(ports), "HITS", hits)
"""


def test_sglang_server_is_started_with_an_api_key_no_other_uid_can_read(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    # WAS: `launch_command` started sglang.launch_server with no --api-key/--admin-api-key (and the
    # client sent no Authorization), so any local process could call /generate, /abort_request,
    # /update_weights_from_disk, /release_memory_occupation on the cell's engine. Now `launch_engine`
    # gives every server a fresh key through `--config FILE` (SGLang reads api_key from no environment
    # variable), the file 0600 in a 0700 folder, never on the command line (/proc/PID/cmdline is
    # readable by every uid), and its client sends that key.
    from fake_sglang import key_from_command

    import gyre_ray.engines.sglang as sglang_package
    from gyre_ray.engines.config import EngineSection
    from gyre_ray.engines.sglang.server import SGLangServer
    from gyre_ray.engines.testing import small_model

    seen: dict = {}

    def start(server: SGLangServer) -> None:  # what the process would get, checked instead of run
        seen.update(command=list(server.command), key=key_from_command(server.command), file=server.key_file)
        seen.update(
            file_mode=server.key_file.stat().st_mode, folder_mode=server.key_file.parent.stat().st_mode
        )

    monkeypatch.setattr(sglang_package, "check_available", lambda cell_id, gpus: None)
    monkeypatch.setattr(SGLangServer, "start", start)
    monkeypatch.setattr(SGLangServer, "wait_healthy", lambda server, timeout_s: None)
    args = small_model().args
    engines = [
        sglang_package.launch_engine(
            EngineSection(backend="sglang"), None, args, model_dir="/models/m", cell_id="c", gpu_ids=["0"]
        )
        for _ in range(2)
    ]
    key = seen["key"]
    assert key and key.startswith("gyre-") and len(key) >= 40, seen
    assert "--api-key" not in seen["command"] and all(key not in arg for arg in seen["command"])
    assert seen["file_mode"] & 0o077 == 0 and seen["folder_mode"] & 0o077 == 0
    assert engines[1].client._headers == {"Authorization": f"Bearer {key}"}  # the last server's key
    assert engines[0].client._headers != engines[1].client._headers  # one key per server
    for engine in engines:
        engine.shutdown()
    assert not seen["file"].parent.exists()  # the key's folder goes with the server


@needs_root
def test_a_sandboxed_agent_cannot_reach_the_rollout_engine_directly(exec_tmp: Path) -> None:
    # WAS: the agent found the engine's loopback port in /proc/net/tcp and called its admin routes
    # (here /abort_request with abort_all) with no key, past the proxy. FakeSGLang answers as a real
    # SGLang server started by `launch_command` does: with a key of its own (here a fresh one, as the
    # engine makes), it refuses every route but /health* to a caller without it.
    from fake_sglang import FakeSGLang

    from gyre_ray.engines.sglang.server import new_api_key
    from gyre_ray.engines.testing import small_engine, small_model

    backing = small_engine(small_model())
    fake = FakeSGLang(backing, api_key=new_api_key())
    try:
        out = run_execution(
            "S", make_task(), NOWHERE, exec_tmp / "workspaces" / "S", command=py(SCAN_AND_ABORT), timeout_s=60
        )
    finally:
        fake.close()
        backing.shutdown()
    assert "/abort_request" not in fake.routes(), out.log_tail
    assert "/get_server_info" in fake.refused, (fake.refused, out.log_tail)  # it was found, and refused
