"""`gyre-ray logprobs`: the torch and Megatron backends score a sequence from an HF folder alike, and
as the model does; text goes through the folder's tokenizer; bad input is one line and exit code 2."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from megatron_cases import hf_folder, require_megatron

from gyre_ray.cli import main
from gyre_ray.model.arch import ModelArgs
from gyre_ray.model.checkpoint import load_hf, save_hf
from gyre_ray.model.qwen3 import Qwen3ForCausalLM, init_weights
from gyre_ray.model.tokenizer import Tokenizer

TOKENS = [3, 17, 200, 45, 9, 120, 77]


def run(capsys: pytest.CaptureFixture, *argv: str) -> tuple[int, str, str]:
    code = main(["logprobs", *argv])
    out, err = capsys.readouterr()
    return code, out, err


def test_megatron_and_torch_score_tokens_like_the_model(
    tmp_path: Path, capsys: pytest.CaptureFixture
) -> None:
    require_megatron()
    folder = hf_folder(tmp_path, tied=False)
    tokens = ",".join(map(str, TOKENS))
    scores = {}
    for backend in ("torch", "megatron"):
        code, out, err = run(
            capsys, "--model-dir", str(folder), "--trainer-backend", backend, "--tokens", tokens, "--json"
        )
        assert code == 0, err
        scores[backend] = json.loads(out)
    model, _ = load_hf(folder)
    with torch.no_grad():
        logp = torch.log_softmax(model(torch.tensor([TOKENS]))[0], -1)
    expected = [float(logp[i - 1, t]) for i, t in enumerate(TOKENS) if i > 0]
    for backend, reply in scores.items():
        assert reply["backend"] == backend and reply["token_ids"] == TOKENS and reply["logprobs"][0] is None
        assert max(abs(a - b) for a, b in zip(reply["logprobs"][1:], expected, strict=True)) < 1e-5
        assert reply["sum"] == pytest.approx(sum(expected), abs=1e-4)


def test_text_is_scored_through_the_folders_tokenizer(tmp_path: Path, capsys: pytest.CaptureFixture) -> None:
    args = ModelArgs.tiny()
    args.num_hidden_layers = 1
    folder = save_hf(init_weights(Qwen3ForCausalLM(args), 1), args, tmp_path / "tiny", Tokenizer.default())
    code, out, err = run(capsys, "--model-dir", str(folder), "--text", "hello world")
    assert code == 0, err
    lines = out.strip().splitlines()
    ids = Tokenizer.default().encode("hello world")
    assert len(lines) == len(ids) + 1 and lines[0].split()[2] == "-"
    assert all(float(line.split()[2]) <= 0 for line in lines[1:-1])
    assert lines[-1].startswith("sum ") and f"over {len(ids) - 1} predicted" in lines[-1]


@pytest.mark.parametrize(
    ("argv", "message"),
    [
        (["--tokens", "1,x"], "comma-separated integers"),
        (["--tokens", "1,999"], "outside the vocabulary"),
        (["--tokens", "1,2", "--tp", "2"], "needs --trainer-backend megatron"),
        (["--text", "hi"], "needs a tokenizer.json"),
        (["--tokens", "7"], "the first is only context, so give at least 2"),
    ],
)
def test_bad_input_is_one_line_and_exit_code_2(
    tmp_path: Path, capsys: pytest.CaptureFixture, argv: list[str], message: str
) -> None:
    folder = hf_folder(tmp_path, tied=True)
    code, out, err = run(capsys, "--model-dir", str(folder), *argv)
    assert code == 2 and out == "" and message in err and len(err.strip().splitlines()) == 1
    code, _, err = run(capsys, "--model-dir", str(tmp_path / "missing"), "--tokens", "1,2")
    assert code == 2 and "cannot load the model" in err
