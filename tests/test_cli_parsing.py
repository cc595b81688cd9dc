"""Command-line parsing: a nested sub-command's bad flag gets that sub-command's own usage line."""

from __future__ import annotations

import pytest

from gyre_ray.cli import main


@pytest.mark.parametrize(
    ("argv", "usage"),
    [
        (["traj", "show", "records", "--bogus"], "usage: gyre-ray traj show"),
        (["simulate", "--bogus"], "usage: gyre-ray simulate"),
        (["--bogus"], "usage: gyre-ray [-h]"),
    ],
)
def test_an_unknown_flag_gets_the_innermost_commands_usage(
    capsys: pytest.CaptureFixture, argv: list[str], usage: str
) -> None:
    with pytest.raises(SystemExit) as exit_:
        main(argv)
    err = capsys.readouterr().err
    assert exit_.value.code == 2 and err.startswith(usage) and "unrecognized arguments: --bogus" in err


def test_a_proxy_port_in_use_is_named_before_serve_starts(monkeypatch: pytest.MonkeyPatch) -> None:
    import socket

    from gyre_ray.config import ConfigError
    from gyre_ray.proxy import launch
    from gyre_ray.proxy.config import ProxySection

    with socket.socket() as held:
        held.bind(("127.0.0.1", 0))
        held.listen()
        port = held.getsockname()[1]
        monkeypatch.setattr(launch, "_serve_running", lambda: False)
        with pytest.raises(ConfigError, match=f"proxy.port={port}: 127.0.0.1:{port} is already in use"):
            launch.refuse_busy_port(ProxySection(port=port))
        launch.refuse_busy_port(ProxySection(port=0))  # any free port: nothing to refuse
        monkeypatch.setattr(launch, "_serve_running", lambda: True)
        launch.refuse_busy_port(ProxySection(port=port))  # a running Serve keeps its own port
    monkeypatch.setattr(launch, "_serve_running", lambda: False)
    with socket.socket() as serve_like:  # another Serve's proxy: SO_REUSEPORT, which Serve's shares
        serve_like.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEPORT, 1)
        serve_like.bind(("127.0.0.1", 0))
        serve_like.listen()
        launch.refuse_busy_port(ProxySection(port=serve_like.getsockname()[1]))


def test_a_run_stopped_by_a_config_error_does_not_point_to_a_resume(
    tmp_path, capsys: pytest.CaptureFixture
) -> None:
    import json

    from gyre_ray.config import ConfigError
    from gyre_ray.train import FAILED_FILE, note_failure

    note_failure(tmp_path, ConfigError("proxy.port=8000: 127.0.0.1:8000 is already in use"))
    err = capsys.readouterr().err
    assert "the run did not start" in err and "resume" not in err and "checkpoint" not in err
    assert "proxy.port=8000" in json.loads((tmp_path / FAILED_FILE).read_text())["error"]
    note_failure(tmp_path, RuntimeError("the core died"))  # anything else: how to go on
    assert "no checkpoint to resume from yet" in capsys.readouterr().err
