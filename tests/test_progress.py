"""The progress line ends with what happened: done, interrupted (Ctrl-C) or stopped on an error."""

from __future__ import annotations

import io

import pytest

from gyre_ray.observability.progress import Progress


@pytest.mark.parametrize(
    ("raised", "end"),
    [(None, "done"), (KeyboardInterrupt, "interrupted"), (RuntimeError, "stopped on an error")],
)
def test_the_last_line_says_how_the_work_ended(raised: type[BaseException] | None, end: str) -> None:
    stream = io.StringIO()

    def work() -> None:
        with Progress("run", total=3, stream=stream) as progress:
            progress.update(done=1)
            if raised is not None:
                raise raised

    if raised is None:
        work()
    else:
        with pytest.raises(raised):  # said, never swallowed: the error still reaches the caller
            work()
    last = stream.getvalue().splitlines()[-1]
    assert last.startswith("run") and "1/3" in last and last.endswith(end)


def test_a_run_whose_scheduler_raised_ends_its_progress_line_on_the_error(monkeypatch, capsys) -> None:
    """`drive` fetched the scheduler's result after the progress block had closed, so a run that
    raised ended its line "done" and the error came after it."""
    from types import SimpleNamespace

    import ray

    from gyre_ray.config import load_config
    from gyre_ray.drive import drive

    class Remote:
        def __init__(self, value):
            self.value = value

        def remote(self, *args, **kwargs):
            return self.value

    class Failed(RuntimeError):
        pass

    def get(ref, timeout=None):
        if ref == "done":
            raise Failed("the core cell died")
        return ref

    monkeypatch.setattr(ray, "get", get)
    monkeypatch.setattr(ray, "wait", lambda refs, timeout=None: (refs, []))
    scheduler = SimpleNamespace(
        run=Remote("done"), metrics_since=Remote([]), progress=Remote({"started": False})
    )
    runtime = SimpleNamespace(scheduler=scheduler, core=SimpleNamespace(trainer_version=Remote(0)))
    cfg = load_config(None, ["run.steps=6", "run.eval_every=0"])
    with pytest.raises(Failed):
        drive(runtime, cfg, None, None, (0, 0.0), None)
    last = capsys.readouterr().err.strip().splitlines()[-1]
    assert last.endswith("stopped on an error"), last
