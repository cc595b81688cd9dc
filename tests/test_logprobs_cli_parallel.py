"""`gyre-ray logprobs --tp N --cp M`: the Megatron backend split over tensor and context parallel ranks
scores a sequence as torch does; `--cp` is refused on the torch backend and below 1."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from megatron_cases import hf_folder, require_megatron

from gyre_ray.cli import main

TOKENS = [3, 17, 200, 45, 9, 120, 77]


def score(capsys: pytest.CaptureFixture, folder: Path, *argv: str) -> dict:
    code = main(
        ["logprobs", "--model-dir", str(folder), "--tokens", ",".join(map(str, TOKENS)), "--json", *argv]
    )
    out, err = capsys.readouterr()
    assert code == 0, err
    return json.loads(out)


def test_context_parallel_ranks_score_like_torch(tmp_path: Path, capsys: pytest.CaptureFixture) -> None:
    require_megatron()
    folder = hf_folder(tmp_path, tied=False)
    reference = score(capsys, folder)
    split = score(capsys, folder, "--trainer-backend", "megatron", "--cp", "2")
    assert split["backend"] == "megatron" and split["context_parallel_size"] == 2
    assert (
        split["tensor_parallel_size"] == 1 and split["token_ids"] == TOKENS and split["logprobs"][0] is None
    )
    diffs = [abs(a - b) for a, b in zip(split["logprobs"][1:], reference["logprobs"][1:], strict=True)]
    assert max(diffs) < 1e-5, diffs


@pytest.mark.parametrize("argv", [["--cp", "2"], ["--trainer-backend", "megatron", "--cp", "0"]])
def test_cp_without_megatron_or_below_1_is_one_line(
    tmp_path: Path, capsys: pytest.CaptureFixture, argv: list[str]
) -> None:
    folder = hf_folder(tmp_path, tied=True)
    code = main(["logprobs", "--model-dir", str(folder), "--tokens", "1,2", *argv])
    out, err = capsys.readouterr()
    assert code == 2 and out == "" and len(err.strip().splitlines()) == 1
    assert "context parallelism needs --trainer-backend megatron and cp >= 1" in err
