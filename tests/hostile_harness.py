"""A test harness that misbehaves on purpose, chosen by the execution's index in its group (the
workspace name's last part): 0 solves half the task, 1 exits at once, 2 spies on its neighbours
then forks without end, 3 prints binary garbage and fills the disk. Used through the training job
as `agents.harness=command`."""

from __future__ import annotations

import json
import os
import sys
import time
from pathlib import Path

RLE_HALF = (
    "import itertools\n"
    "def encode(t): return [(k, len(list(g))) for k, g in itertools.groupby(t)]\n"
    'def decode(runs): return ""\n'
)


def call_model() -> None:
    from openai import OpenAI

    OpenAI(max_retries=0).chat.completions.create(
        model="policy", messages=[{"role": "user", "content": os.environ["GYRE_TASK_PROMPT"]}], max_tokens=4
    )


def spy(workspace: Path) -> dict:
    run_dir = workspace.parent.parent
    seen: dict = {"env_secrets": [k for k in os.environ if "WANDB" in k or "AWS" in k or "ADMIN" in k]}
    targets = [workspace.parent, run_dir, run_dir / "records", run_dir / "config.json"]
    targets += [workspace.parent / workspace.name.replace("-2", f"-{i}") for i in (0, 1, 3)]
    targets += [
        workspace.parent / f"{workspace.name[:-1]}0.log",
        workspace.parent / f"{workspace.name[:-1]}0.home",
    ]
    for target in targets:
        try:
            seen[str(target)] = sorted(os.listdir(target)) if target.is_dir() else target.read_text()[:100]
        except OSError as exc:
            seen[str(target)] = f"DENIED {type(exc).__name__}"
    return seen


def main() -> None:
    workspace = Path(os.environ["GYRE_WORKSPACE"])
    index = workspace.name.rsplit("-", 1)[-1]
    if index == "1":
        return
    call_model()
    if index == "0":
        (workspace / "rlekit").mkdir()
        (workspace / "rlekit" / "__init__.py").write_text(RLE_HALF)
    elif index == "2":
        (workspace / "spy.json").write_text(json.dumps(spy(workspace)))
        while True:
            try:
                os.fork()
            except OSError:
                time.sleep(0.01)
    else:
        sys.stdout.buffer.write(os.urandom(1 << 20))
        sys.stdout.flush()
        i = 0
        while True:
            (workspace / f"fill{i}.bin").write_bytes(os.urandom(1 << 20))
            i += 1


if __name__ == "__main__":
    main()
