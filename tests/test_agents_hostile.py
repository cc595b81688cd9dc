"""Hostile harnesses cannot hurt the run: each ends as a scored or dropped execution with its reason.

Harnesses here read a neighbour's workspace, HOME, log and key, look for the job's secrets, fork
without end, fill the disk, hog memory, exit at once, or print binary garbage. These run as root
with a uid per execution, as the job does on these machines (and in CI).
"""

from __future__ import annotations

import contextlib
import json
import os
import pwd
import sys
import threading
import time
from pathlib import Path

import pytest
from served_proxy import ServedProxy

from gyre_ray.agents.runner import Endpoint, run_execution
from gyre_ray.agents.sandbox import USER_PREFIX, Limits, can_create_users, protect_job_folders
from gyre_ray.cells.factories import ScriptedEngineFactory
from gyre_ray.envs.base import EvalResult, Task
from gyre_ray.envs.toy import char_coverage_evaluator
from gyre_ray.proxy.config import ProxySection

pytestmark = pytest.mark.skipif(
    not can_create_users() and os.environ.get("CI") != "true", reason="needs root and useradd"
)
NOWHERE = Endpoint("http://127.0.0.1:9", "key-of-nobody")
SECRETS = {"WANDB_API_KEY": "wandb-secret-7731", "AWS_SECRET_ACCESS_KEY": "aws-secret-9924"}


def _py(code: str) -> list[str]:
    return [sys.executable, "-c", code]


def _task(evaluate=None) -> Task:
    return Task("t", "do it", evaluate=evaluate or (lambda ws: EvalResult(0.5)))


def _pool_uids() -> set[int]:
    return {p.pw_uid for p in pwd.getpwall() if p.pw_name.startswith(USER_PREFIX)}


def _pool_pids(uids: set[int]) -> list[int]:
    """Live processes of `uids`. Executions of other tests running at the same time (pytest-xdist,
    other sessions) hold other pool uids, so a test counts its own execution's uid only."""
    found = []
    for entry in os.listdir("/proc"):
        try:
            if entry.isdigit() and os.stat(f"/proc/{entry}").st_uid in uids:
                state = Path(f"/proc/{entry}/stat").read_text().rsplit(")", 1)[1].split()[0]
                found.append(int(entry)) if state not in "ZX" else None
        except (OSError, IndexError):
            continue
    return found


PROBE = """
import json, os, sys
targets = sys.argv[1:]
seen = {}
for path in targets:
    try:
        seen[path] = open(path, "rb").read(200).decode(errors="replace")
    except OSError as exc:
        seen[path] = "DENIED " + type(exc).__name__
for pid in [p for p in os.listdir("/proc") if p.isdigit()]:
    try:
        data = open(f"/proc/{pid}/environ", "rb").read().decode(errors="replace")
    except OSError:
        continue
    for word in ("key-A", "wandb-secret", "aws-secret", "gyre-admin"):
        if word in data and str(os.getpid()) != pid:
            seen[f"/proc/{pid}/environ"] = word
try:
    seen["listing"] = os.listdir(os.path.dirname(os.getcwd()))
except OSError as exc:
    seen["listing"] = "DENIED " + type(exc).__name__
seen["env"] = dict(os.environ)
json.dump(seen, open("probe.json", "w"))
"""


def test_a_neighbour_sees_no_workspace_home_log_key_or_job_secret(exec_tmp: Path, monkeypatch) -> None:
    for name, value in SECRETS.items():
        monkeypatch.setenv(name, value)
    root = exec_tmp / "run" / "workspaces"
    protect_job_folders(root)  # as every execution's start in the job does (agents/launch.py)
    a_ws, b_ws = root / "A", root / "B"
    writer = "import os, time; open('secret.txt','w').write('A-SECRET'); "
    writer += (
        "open(os.environ['HOME'] + '/secret.txt','w').write('A-SECRET'); print('A-SECRET'); time.sleep(5)"
    )
    results = {}

    def run_a() -> None:
        results["A"] = run_execution(
            "A", _task(), Endpoint("http://127.0.0.1:9", "key-A"), a_ws, command=_py(writer), timeout_s=30
        )

    thread = threading.Thread(target=run_a)
    thread.start()
    deadline = time.monotonic() + 20
    while not (a_ws / "secret.txt").exists():  # the job (root) can see it; B should not
        assert time.monotonic() < deadline
        time.sleep(0.05)
    targets = [a_ws / "secret.txt", root / "A.home/secret.txt", root / "A.log"]  # all there by now
    probe = _py(PROBE)[:3] + [str(t) for t in targets]
    results["B"] = run_execution(
        "B", _task(), Endpoint("http://127.0.0.1:9", "key-B"), b_ws, command=probe, timeout_s=30
    )
    thread.join()
    seen = json.loads((b_ws / "probe.json").read_text())
    for target in targets:
        assert seen[str(target)] == "DENIED PermissionError", (target, seen[str(target)])
    assert str(seen["listing"]).startswith("DENIED"), seen["listing"]  # no neighbour's names either
    assert not any(k.startswith("/proc/") for k in seen), "another process's environment was readable"
    env = seen["env"]
    assert env["OPENAI_API_KEY"] == "key-B" and not set(SECRETS) & set(env)
    assert "A-SECRET" not in json.dumps(seen) and "key-A" not in json.dumps(seen)
    assert results["A"].valid and results["B"].valid and results["A"].exit_code == 0
    # Afterwards A's folders belong to the job again: the next holder of A's uid cannot read them.
    assert (a_ws / "secret.txt").stat().st_uid == os.geteuid()
    later = run_execution("C", _task(), NOWHERE, root / "C", command=probe, timeout_s=30)
    assert later.valid
    assert json.loads((root / "C/probe.json").read_text())[str(targets[0])].startswith("DENIED")


def test_a_fork_bomb_stays_within_its_process_limit_and_its_tree_ends(exec_tmp: Path) -> None:
    bomb = (
        "import os, time\nopen('uid.txt', 'w').write(str(os.getuid()))\n"
        "while True:\n    try:\n        os.fork()\n    except OSError:\n        time.sleep(0.01)"
    )
    peak, stop, uid_file = [0], threading.Event(), exec_tmp / "ws" / "uid.txt"

    def sample() -> None:
        while not stop.is_set():
            with contextlib.suppress(OSError, ValueError):  # counted once the bomb has said its uid
                peak[0] = max(peak[0], len(_pool_pids({int(uid_file.read_text())})))
            time.sleep(0.05)

    sampler = threading.Thread(target=sample)
    sampler.start()
    start = time.monotonic()
    try:
        out = run_execution(
            "bomb", _task(), NOWHERE, exec_tmp / "ws", command=_py(bomb), timeout_s=6,
            limits=Limits(max_processes=24),
        )  # fmt: skip
    finally:
        stop.set()
        sampler.join()
    assert out.valid and out.reward == 0.5  # still scored: its workspace is evaluated
    assert "timed out" in out.reason or "process limit" in out.reason
    assert time.monotonic() - start < 60
    # the rlimit (24), plus the kill helpers the watchdog starts as that uid and processes seen mid-exit
    assert 1 < peak[0] <= 24 + 8
    uid = int(uid_file.read_text())
    assert uid in _pool_uids() and _pool_pids({uid}) == []


def test_filling_the_disk_or_memory_is_cut_off_with_a_reason(exec_tmp: Path) -> None:
    filler = (
        "import signal, os\nsignal.signal(signal.SIGXFSZ, signal.SIG_IGN)\n"
        "try:\n    open('big.bin','wb').write(b'x' * (12 << 20))\nexcept OSError as exc:\n    print('EFBIG', exc)\n"
        "i = 0\nwhile True:\n    open(f'f{i}.bin','wb').write(os.urandom(1 << 20)); i += 1"
    )
    out = run_execution(
        "disk", _task(), NOWHERE, exec_tmp / "ws", command=_py(filler), timeout_s=60,
        limits=Limits(max_file_mb=4, max_disk_mb=24),
    )  # fmt: skip
    assert out.valid and "disk limit (24 MiB)" in out.reason and not out.timed_out
    assert (exec_tmp / "ws/big.bin").stat().st_size == 4 << 20  # one file stops at max_file_mb
    used = sum(p.stat().st_size for p in (exec_tmp / "ws").iterdir()) >> 20
    assert 24 <= used < 200, used
    hog = "import time; block = b'x' * (600 << 20); time.sleep(60)"
    out = run_execution(
        "mem", _task(), NOWHERE, exec_tmp / "ws2", command=_py(hog), timeout_s=60,
        limits=Limits(max_memory_mb=200),
    )  # fmt: skip
    assert out.valid and "memory limit (200 MiB)" in out.reason and not out.timed_out


FILLER = "import os\ni = 0\nwhile True:\n    open(f'f{i}.bin','wb').write(os.urandom(1 << 20)); i += 1"


def test_a_slow_walk_of_shared_scratch_does_not_blind_the_disk_watch(exec_tmp: Path, monkeypatch) -> None:
    """A busy shared /tmp took 0.5 s and more to walk under load; the workspace, walked in the same loop
    after it, went unmeasured that long, and a filler wrote 297 MiB past a 24 MiB limit. Each measure now
    runs on its own: with the shared walk taking 3 s, the workspace's is still taken every few tenths."""
    import gyre_ray.agents.supervise as supervise_module

    real = supervise_module.scratch_usage

    def slow_scratch_usage(*args, **kwargs):
        time.sleep(3.0)
        return real(*args, **kwargs)

    monkeypatch.setattr(supervise_module, "scratch_usage", slow_scratch_usage)
    monkeypatch.setattr(supervise_module, "private_mounts_work", lambda: False)  # the shared /tmp is walked
    out = run_execution(
        "slow", _task(), NOWHERE, exec_tmp / "ws", command=_py(FILLER), timeout_s=60,
        limits=Limits(max_disk_mb=24),
    )  # fmt: skip
    assert out.valid and "disk limit (24 MiB)" in out.reason and not out.timed_out
    used = sum(p.stat().st_size for p in (exec_tmp / "ws").iterdir()) >> 20
    assert 24 <= used < 150, used


def test_a_workspace_under_shared_scratch_counts_once(exec_tmp: Path, monkeypatch) -> None:
    """A run folder under a shared /tmp (a host refusing the private mounts): the workspace's files are
    the uid's files in /tmp as well, and were counted twice, so 16 MiB written passed a 24 MiB limit."""
    import gyre_ray.agents.supervise as supervise_module

    monkeypatch.setattr(supervise_module, "private_mounts_work", lambda: False)
    writer = "open('a.bin','wb').write(b'x' * (8 << 20)); open('b.bin','wb').write(b'y' * (8 << 20))"
    writer += "\nimport time; time.sleep(3)"
    assert str(exec_tmp).startswith("/tmp/")
    out = run_execution(
        "once", _task(), NOWHERE, exec_tmp / "ws", command=_py(writer), timeout_s=60,
        limits=Limits(max_disk_mb=24),
    )  # fmt: skip
    assert out.valid and out.exit_code == 0 and "limit" not in out.reason, out.reason
    assert sum(p.stat().st_size for p in (exec_tmp / "ws").iterdir()) >> 20 == 16


@pytest.fixture(scope="module")
def served(tmp_path_factory):
    proxy = ServedProxy(
        ScriptedEngineFactory({"reply_length": 6}), tmp_path_factory.mktemp("proxy"), ProxySection()
    )
    yield proxy
    proxy.close()


CALL_THEN_GARBAGE = (
    "import os, sys\nfrom openai import OpenAI\n"
    "OpenAI(max_retries=0).chat.completions.create(model='p', messages=[{'role': 'user', 'content': 'hi'}], "
    "max_tokens=4)\n"
    "sys.stdout.buffer.write(os.urandom(1 << 20)); open('answer.txt','wb').write(os.urandom(4096) + b'aeiou')\n"
    "sys.exit(3)"
)


def test_an_execution_without_calls_is_dropped_and_garbage_is_still_scored(exec_tmp: Path, served) -> None:
    quiet = served.proxy.register_execution()
    endpoint = Endpoint(served.base_url, quiet["api_key"])
    out = run_execution(
        quiet["execution_id"], _task(), endpoint, exec_tmp / "quiet", command=_py("pass"), timeout_s=30,
        require_calls=True,
    )  # fmt: skip
    assert not out.valid and out.calls == 0 and out.reason == "no model calls"
    noisy = served.proxy.register_execution()
    endpoint = Endpoint(served.base_url, noisy["api_key"])
    out = run_execution(
        noisy["execution_id"], _task(char_coverage_evaluator("aeiou")), endpoint, exec_tmp / "noisy",
        command=_py(CALL_THEN_GARBAGE), timeout_s=60, require_calls=True,
    )  # fmt: skip
    assert out.calls == 1 and out.exit_code == 3 and out.valid
    assert out.reason == "harness exited with code 3" and out.reward > 0
    assert isinstance(out.log_tail, str) and len(out.log_tail) <= 2000
