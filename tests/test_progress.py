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
