"""The default tokenizer round-trips any text, keeps special tokens whole and fits agent requests."""

from __future__ import annotations

import json
import random
import shutil

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from gyre_ray.model.arch import TINY_SPECIAL_TOKENS, ModelArgs
from gyre_ray.model.build_tokenizer import build
from gyre_ray.model.chat_template import render
from gyre_ray.model.tokenizer import ASSETS, Tokenizer

WORDS_TEXT = (
    "the a to of and in is for that with file path command when use this tool you must not be run "
    "output string optional default value returns if it an or by are from as only on can should "
    "directory search pattern results lines user task agent edit read write new old replace before "
    "after absolute relative timeout milliseconds background shell git commit branch test code "
    "function class parameter description required number boolean array object format json url"
)
WORDS = WORDS_TEXT.split()


def claude_like_request(rng: random.Random, tools: int = 24, target_bytes: int = 78_000) -> str:
    """A JSON request shaped like Claude Code's first call: system text, tool schemas, messages."""

    def prose(n: int) -> str:
        words = [rng.choice(WORDS) for _ in range(n)]
        return " ".join(words).capitalize() + "."

    def schema() -> dict:
        props = {
            f"{rng.choice(WORDS)}_{rng.choice(WORDS)}": {
                "type": rng.choice(["string", "number", "boolean", "array"]),
                "description": prose(rng.randint(8, 40)),
            }
            for _ in range(rng.randint(2, 6))
        }
        return {
            "type": "object",
            "properties": props,
            "required": sorted(props)[:1],
            "additionalProperties": False,
            "$schema": "http://json-schema.org/draft-07/schema#",
        }

    request = {
        "model": "claude-opus",
        "system": [{"type": "text", "text": " ".join(prose(30) for _ in range(35))}],
        "tools": [],
        "messages": [{"role": "user", "content": [{"type": "text", "text": prose(1200)}]}],
        "max_tokens": 64000,
        "stream": True,
    }
    while len(json.dumps(request)) < target_bytes:
        description = "\n".join(prose(rng.randint(20, 60)) for _ in range(rng.randint(3, 12)))
        request["tools"].append(
            {"name": rng.choice(WORDS).capitalize(), "description": description, "input_schema": schema()}
        )
    return json.dumps(request)


@pytest.fixture(scope="module")
def tok() -> Tokenizer:
    return Tokenizer.default()


@settings(max_examples=200, deadline=None)
@given(st.text(max_size=300))
def test_any_unicode_text_round_trips(text):
    tok = Tokenizer.default()
    ids = tok.encode(text)
    assert all(0 <= i < tok.vocab_size for i in ids)
    assert tok.decode(ids) == text


def test_special_tokens_are_single_ids_matching_the_tiny_model(tok):
    args = ModelArgs.tiny()
    assert tok.vocab_size == args.vocab_size == 8192
    for expected_id, token in enumerate(TINY_SPECIAL_TOKENS):
        assert tok.token_to_id(token) == expected_id
        assert tok.encode(f"a{token}b") == [*tok.encode("a"), expected_id, *tok.encode("b")]
    assert tok.special_ids == frozenset(range(len(TINY_SPECIAL_TOKENS)))
    assert (tok.eos_id, tok.pad_id) == (args.eos_token_id, args.pad_token_id)
    assert (tok.im_start_id, tok.im_end_id) == (1, 2)
    text = "<|im_start|>user\nhi<|im_end|>"
    assert tok.decode(tok.encode(text), skip_special_tokens=True) == "user\nhi"
    assert tok.token_to_id("no-such-token") is None


def test_a_78kb_agent_request_fits_the_context_with_room_to_generate(tok):
    request = claude_like_request(random.Random(0))
    assert len(request.encode()) >= 78_000
    prompt = render([{"role": "user", "content": request}])
    n_tokens = len(tok.encode(prompt))
    room = ModelArgs.tiny().max_position_embeddings - n_tokens
    # Claude Code asks for max_tokens 64000 and gets what fits; at least 16k tokens must remain.
    assert room >= 16_384, f"{n_tokens} prompt tokens leave only {room} of the context"
    assert len(request.encode()) / n_tokens > 2.5  # far better than one token per byte


def test_decode_rejects_ids_outside_the_vocabulary(tok):
    with pytest.raises(ValueError, match=r"outside the vocabulary \[0, 8192\)"):
        tok.decode([5, 8192])


def test_hf_folder_with_tokenizer_json_and_chat_template_loads(tmp_path):
    shutil.copy(ASSETS / "tokenizer.json", tmp_path / "tokenizer.json")
    template = "{% for m in messages %}[{{ m.role }}]{{ m.content }}<|endoftext|>{% endfor %}"
    config = {"eos_token": {"content": "<|endoftext|>"}, "pad_token": "<|im_end|>", "chat_template": template}
    (tmp_path / "tokenizer_config.json").write_text(json.dumps(config))
    folder_tok = Tokenizer.from_folder(tmp_path)
    assert folder_tok.eos_id == 0 and folder_tok.pad_id == 2
    assert folder_tok.chat_template == template
    assert folder_tok.encode("héllo wörld") == Tokenizer.default().encode("héllo wörld")
    # transformers saves the template as chat_template.jinja next to a config without one
    (tmp_path / "tokenizer_config.json").write_text("{}")
    (tmp_path / "chat_template.jinja").write_text(template)
    assert Tokenizer.from_folder(tmp_path).chat_template == template
    assert Tokenizer.from_folder(tmp_path).eos_id == 2  # falls back to <|im_end|>
    with pytest.raises(FileNotFoundError, match="tokenizer.json"):
        Tokenizer.from_folder(tmp_path / "missing")


def test_build_script_trains_a_byte_level_bpe_with_specials_first():
    small = Tokenizer(build(corpus_bytes=200_000, vocab_size=600))
    assert small.vocab_size == 600
    assert [small.token_to_id(t) for t in TINY_SPECIAL_TOKENS] == list(range(len(TINY_SPECIAL_TOKENS)))
    text = "def f(x):\n    return {'ключ': x}  # 🎉"
    assert small.decode(small.encode(text)) == text
    assert len(small.encode("    return self")) < len(b"    return self")
