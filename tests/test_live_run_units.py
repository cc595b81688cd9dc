"""A run that outlives its driver, without Ray: the scheduler actor's `RunKeeper` (a driver that attaches
gets the result of the run another driver started, or starts it when the actor holds none) and
`gyre_ray.live_run`'s file and refusals (nothing alive, no cluster, `--resume` of a live run)."""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
import threading
import time
from pathlib import Path
from types import SimpleNamespace

import pytest

from gyre_ray import live_run
from gyre_ray.cli import main
from gyre_ray.config import ConfigError, load_config
from gyre_ray.runtime.run_keeper import RunKeeper, run_key

KEY = run_key(2, {"first_step": 0, "checkpoint_every": 0})


def test_a_join_waits_for_the_run_under_way_and_gets_its_result() -> None:
    keeper, release, bodies = RunKeeper(), threading.Event(), []

    def body() -> dict:
        bodies.append("run")
        release.wait(10)
        return {"steps": [0, 1]}

    runner = threading.Thread(target=keeper.run, args=(KEY, body))
    runner.start()
    while not bodies:
        time.sleep(0.01)
    assert keeper.state() == {"key": KEY, "running": True, "failed": False}
    joined: list = []
    joiner = threading.Thread(target=lambda: joined.append(keeper.join(KEY, lambda: bodies.append("join"))))
    joiner.start()
    time.sleep(0.1)
    assert not joined  # still waiting for the run
    release.set()
    runner.join(10)
    joiner.join(10)
    assert joined == [{"steps": [0, 1]}] and bodies == ["run"]  # the run ran once
    assert keeper.join(KEY, lambda: bodies.append("again")) == {"steps": [0, 1]} and bodies == ["run"]


def test_a_join_raises_the_error_the_run_ended_with() -> None:
    keeper = RunKeeper()
    with pytest.raises(TimeoutError, match="steps"):
        keeper.run(KEY, lambda: (_ for _ in ()).throw(TimeoutError("the run did not finish 2 steps")))
    assert keeper.state()["failed"]
    with pytest.raises(TimeoutError, match="steps"):
        keeper.join(KEY, lambda: pytest.fail("a failed run is not run again"))


def test_a_join_on_an_actor_holding_no_run_runs_it_there() -> None:
    keeper = RunKeeper()  # a restarted scheduler actor: the run died with the old process
    assert keeper.join(KEY, lambda: "reattached") == "reattached"
    assert keeper.state() == {"key": KEY, "running": False, "failed": False}


def test_a_join_never_starts_a_second_run_beside_another() -> None:
    keeper, release = RunKeeper(), threading.Event()
    runner = threading.Thread(target=keeper.run, args=(run_key(4, {}), lambda: release.wait(10)))
    runner.start()
    while not keeper.state()["running"]:
        time.sleep(0.01)
    with pytest.raises(RuntimeError, match="another run"):
        keeper.join(KEY, lambda: pytest.fail("must not run"))
    release.set()
    runner.join(10)


def test_persistent_cluster_is_a_named_address(monkeypatch: pytest.MonkeyPatch) -> None:
    for address, persistent in (("", False), ("local", False), ("127.0.0.1:6379", True), ("auto", True)):
        monkeypatch.setenv("RAY_ADDRESS", address)
        assert live_run.persistent_cluster() is persistent


def _fake_runtime() -> SimpleNamespace:
    cfg = load_config("jobs/configs/toy.yaml", ["run.steps=3", "run.checkpoint_every=1"])
    proxy = SimpleNamespace(
        base_url="http://127.0.0.1:1",
        admin_token="secret",
        serve_url="",
        records_dir="/r",
        cell_ids=["cell-0"],
    )
    return SimpleNamespace(
        config=cfg, proxy=proxy, namespace="gyre-toy-abc", app_name="gyre-proxy", core_id="cell-0"
    )


def test_the_live_file_names_the_run_and_is_the_owners_only(tmp_path: Path) -> None:
    live_run.record(tmp_path, _fake_runtime(), (tmp_path / "ckpt", 1, 12.5), [{"restart": 1}])
    path = tmp_path / live_run.LIVE_FILE
    assert path.stat().st_mode & 0o777 == 0o600
    info = live_run.read(tmp_path)
    assert info["namespace"] == "gyre-toy-abc" and info["run"] == {
        "steps": 3,
        "first_step": 1,
        "checkpoint_every": 1,
    }
    assert info["segment"] == {"checkpoint": str(tmp_path / "ckpt"), "first_step": 1, "offset": 12.5}
    assert info["driver"]["pid"] == os.getpid() and info["core_restarts"] == [{"restart": 1}]
    live_run.record(tmp_path, _fake_runtime(), None, [])
    assert live_run.read(tmp_path)["segment"] is None  # a new run: nothing to merge at its end
    live_run.forget(tmp_path)
    assert live_run.read(tmp_path) is None


def test_logged_steps_counts_the_segment_and_cuts_a_torn_line(tmp_path: Path) -> None:
    rows = [{"step": 0, "loss": 1.0}, {"step": 1, "loss": 0.5}, {"step": 2, "loss": 0.4}]
    path = tmp_path / "metrics.jsonl"
    path.write_text("".join(json.dumps(r) + "\n" for r in rows) + '{"step": 3, "lo')
    assert live_run.logged_steps(tmp_path, first_step=1) == 2
    assert [json.loads(line)["step"] for line in path.read_text().splitlines()] == [0, 1, 2]
    assert live_run.logged_steps(tmp_path / "none", first_step=0) == 0


def test_attach_says_why_not_and_points_at_resume(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    cfg = load_config("jobs/configs/toy.yaml", ["run.steps=3", "run.checkpoint_every=1"])
    monkeypatch.setenv("RAY_ADDRESS", "127.0.0.1:1")
    with pytest.raises(ConfigError, match=r"no live run .*--resume"):
        live_run.attach(cfg, tmp_path)
    live_run.record(tmp_path, _fake_runtime(), None, [])
    monkeypatch.delenv("RAY_ADDRESS")
    with pytest.raises(ConfigError, match="set RAY_ADDRESS"):
        live_run.attach(cfg, tmp_path)
    monkeypatch.setenv("RAY_ADDRESS", "127.0.0.1:1")
    other = load_config("jobs/configs/toy.yaml", ["run.steps=5", "run.checkpoint_every=1"])
    with pytest.raises(ConfigError, match="no longer matches"):
        live_run.attach(other, tmp_path)


def test_attach_refuses_while_the_recorded_driver_runs(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    live_run.record(tmp_path, _fake_runtime(), None, [])
    info = json.loads((tmp_path / live_run.LIVE_FILE).read_text())
    driver = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)", "train"])
    try:
        info["driver"]["pid"] = driver.pid  # a driver that still runs
        # until the child has exec'd, its /proc cmdline is the forked parent's (no "train"): the check
        # would then let the attach through to the unreachable RAY_ADDRESS, which blocks for minutes
        cmdline, deadline = Path(f"/proc/{driver.pid}/cmdline"), time.monotonic() + 30
        while b"train" not in cmdline.read_bytes() and time.monotonic() < deadline:
            time.sleep(0.01)
        (tmp_path / live_run.LIVE_FILE).write_text(json.dumps(info))
        monkeypatch.setenv("RAY_ADDRESS", "127.0.0.1:1")
        cfg = load_config("jobs/configs/toy.yaml", ["run.steps=3", "run.checkpoint_every=1"])
        with pytest.raises(ConfigError, match="still runs on this host"):
            live_run.attach(cfg, tmp_path)
    finally:
        driver.kill()
        driver.wait()


def test_resume_without_a_cluster_drops_a_stale_live_file(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.delenv("RAY_ADDRESS", raising=False)
    live_run.record(tmp_path, _fake_runtime(), None, [])
    live_run.refuse_if_alive(load_config("jobs/configs/toy.yaml"), tmp_path)  # a private Ray died with it
    assert live_run.read(tmp_path) is None


def test_resume_without_a_cluster_refuses_a_run_that_ran_on_one(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Its live-run.json was deleted as stale, though the run may live on there: the local resume
    then wrote into the folder beside the cluster's scheduler."""
    monkeypatch.setenv("RAY_ADDRESS", "10.0.0.5:6379")
    live_run.record(tmp_path, _fake_runtime(), None, [])
    monkeypatch.delenv("RAY_ADDRESS")
    with pytest.raises(
        ConfigError, match="ran on the Ray cluster at 10.0.0.5:6379 .*RAY_ADDRESS=10.0.0.5:6379"
    ):
        live_run.refuse_if_alive(load_config("jobs/configs/toy.yaml"), tmp_path)
    assert live_run.read(tmp_path) is not None  # kept


def test_attach_on_the_command_line_takes_no_overrides(tmp_path: Path, capsys: pytest.CaptureFixture) -> None:
    assert main(["train", "--attach", str(tmp_path), "run.steps=4"]) == 2
    assert "--attach takes the live run as it is" in capsys.readouterr().err


def test_a_ray_address_nothing_answers_at_fails_at_once_in_one_line(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture
) -> None:
    """`ray.init` would wait minutes for the GCS of a wrong RAY_ADDRESS; the job says so in seconds."""
    from gyre_ray.ports import free_port
    from gyre_ray.runtime.cluster import check_ray_address, connect_ray

    address = f"127.0.0.1:{free_port()}"
    monkeypatch.setenv("RAY_ADDRESS", address)
    started = time.monotonic()
    with pytest.raises(ConfigError, match=f"RAY_ADDRESS={address}: no Ray cluster answers there"):
        connect_ray(load_config("jobs/configs/toy.yaml"))
    run_root = tmp_path / "runs"
    assert main(["train", "--config", "jobs/configs/toy.yaml", f"run.run_dir={run_root}"]) == 2
    err = capsys.readouterr().err
    assert "no Ray cluster answers there" in err and "Traceback" not in err
    (folder,) = run_root.iterdir()  # the run folder says why it holds no run
    failed = json.loads((folder / "failed.json").read_text())
    assert failed["error"].startswith("ConfigError: RAY_ADDRESS=") and failed["steps_logged"] == 0
    assert f"{folder / 'failed.json'} says why" in err
    assert time.monotonic() - started < 60
    for other in ("auto", "ray://127.0.0.1:1", "http://127.0.0.1:1"):
        check_ray_address(other)  # left to Ray
    with socket.create_server(("127.0.0.1", 0)) as server:  # something answers: let Ray connect
        check_ray_address(f"127.0.0.1:{server.getsockname()[1]}")
    if socket.has_ipv6:
        try:
            server = socket.create_server(("::1", 0), family=socket.AF_INET6)
        except OSError:  # no IPv6 loopback here
            return
        with server:
            check_ray_address(f"[::1]:{server.getsockname()[1]}")


def test_an_interrupted_run_says_so_in_its_folder(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    from gyre_ray import train as train_module

    def interrupted(*args: object) -> dict:
        raise KeyboardInterrupt

    monkeypatch.setattr(train_module, "_run_segments", interrupted)
    cfg = load_config("jobs/configs/toy.yaml", [f"run.run_dir={tmp_path}"])
    with pytest.raises(KeyboardInterrupt):
        train_module.train(cfg)
    (folder,) = tmp_path.iterdir()
    assert json.loads((folder / "failed.json").read_text())["error"] == "interrupted"


def test_a_run_that_ends_well_leaves_no_failed_note(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """A resumed run that ends removes the failed.json its earlier segment left."""
    from gyre_ray import train as train_module

    folder = tmp_path / "run"
    folder.mkdir()
    (folder / train_module.FAILED_FILE).write_text('{"error": "interrupted"}')
    monkeypatch.setattr(train_module, "new_run_dir", lambda cfg: folder)
    monkeypatch.setattr(train_module, "_run_segments", lambda *args: {"steps": []})
    train_module.train(load_config("jobs/configs/toy.yaml", [f"run.run_dir={tmp_path}"]))
    assert not (folder / train_module.FAILED_FILE).exists()
