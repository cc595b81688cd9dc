"""`gyre-ray generate`: JSON output consistent with the tokenizer, seeded reproducibility, and
one-line errors with exit code 2 for bad input."""

from __future__ import annotations

import importlib.util
import json
import re

import pytest

from gyre_ray.cli import main
from gyre_ray.model.tokenizer import Tokenizer


def generate(capsys: pytest.CaptureFixture, *argv: str) -> tuple[int, str, str]:
    code = main(["generate", *argv])
    out, err = capsys.readouterr()
    return code, out, err


def test_json_output_holds_text_ids_logprobs_and_finish_reason(capsys: pytest.CaptureFixture) -> None:
    code, out, _ = generate(capsys, "--prompt", "hello", "--max-new-tokens", "6", "--seed", "5", "--json")
    assert code == 0
    reply = json.loads(out)
    assert set(reply) == {"text", "token_ids", "logprobs", "finish_reason"}
    assert 1 <= len(reply["token_ids"]) <= 6 and len(reply["logprobs"]) == len(reply["token_ids"])
    assert all(lp <= 0 for lp in reply["logprobs"])
    assert reply["finish_reason"] in ("stop", "length")
    assert reply["text"] == Tokenizer.default().decode(reply["token_ids"], skip_special_tokens=True)
    again = json.loads(
        generate(capsys, "--prompt", "hello", "--max-new-tokens", "6", "--seed", "5", "--json")[1]
    )
    assert again == reply  # same seed, same tokens


def test_plain_output_is_the_text(capsys: pytest.CaptureFixture) -> None:
    code, out, _ = generate(capsys, "--prompt", "hi", "--max-new-tokens", "4", "--temperature", "0")
    greedy = json.loads(
        generate(capsys, "--prompt", "hi", "--max-new-tokens", "4", "--temperature", "0", "--json")[1]
    )
    assert code == 0 and out == greedy["text"] + "\n"


@pytest.mark.parametrize(
    ("argv", "message"),
    [
        (["--prompt", ""], "--prompt is empty"),
        (["--prompt", "x", "--temperature", "nan"], "temperature must be a finite number"),
        (["--prompt", "x", "--max-new-tokens", "0"], "max_new_tokens must be an integer >= 1"),
        (
            ["--prompt", "x", "--max-new-tokens", "70000"],
            r"max_new_tokens \(70000\).*context length of 65536",
        ),
        pytest.param(
            ["--prompt", "x", "engine.backend=sglang"],
            "engine.backend=sglang needs the sglang package",
            marks=pytest.mark.skipif(
                importlib.util.find_spec("sglang") is not None, reason="sglang installed"
            ),
        ),
        (["--prompt", "x", "model.path=/nonexistent/model"], "cannot load the policy"),
    ],
)
def test_bad_input_is_one_line_and_exit_code_2(
    capsys: pytest.CaptureFixture, argv: list[str], message: str
) -> None:
    code, out, err = generate(capsys, *argv)
    assert code == 2 and out == ""
    assert len(err.strip().splitlines()) == 1 and "Traceback" not in err
    assert re.search(message, err)
