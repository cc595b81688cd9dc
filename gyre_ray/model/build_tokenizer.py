"""Regenerate the tiny default tokenizer shipped in `gyre_ray/model/assets/`.

A byte-level BPE (every UTF-8 string round-trips exactly) with 8192 ids, trained with the
`tokenizers` library on a local, deterministic corpus: this interpreter's standard-library Python
sources (code and English docstrings), generated JSON tool schemas of the kind agent harnesses send,
and generated ChatML-framed dialogues with tool calls. Special tokens are whole ids 0..8.

    python -m gyre_ray.model.build_tokenizer [--out DIR] [--corpus-mb 12]

The result depends on the interpreter's stdlib version (3.11 for the shipped asset).
"""

from __future__ import annotations

import argparse
import json
import random
import re
import sysconfig
from collections.abc import Iterator
from pathlib import Path

from tokenizers import Regex, Tokenizer, decoders, models, pre_tokenizers, trainers

from gyre_ray.model.arch import TINY_SPECIAL_TOKENS, TINY_VOCAB_SIZE

ASSETS = Path(__file__).resolve().parent / "assets"
# Qwen2-style split: letters with one leading non-letter, single digits, punctuation runs, newlines.
SPLIT_PATTERN = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}"
    r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)
SKIPPED_DIRS = {"site-packages", "dist-packages", "test", "tests", "idlelib", "lib2to3", "__pycache__"}
TOKENIZER_CONFIG = {
    "tokenizer_class": "PreTrainedTokenizerFast",
    "bos_token": None,
    "eos_token": "<|im_end|>",
    "pad_token": "<|endoftext|>",
    "unk_token": None,
    "additional_special_tokens": list(TINY_SPECIAL_TOKENS[1:]),
    "model_max_length": 65536,
    "clean_up_tokenization_spaces": False,
    "add_prefix_space": False,
}


def stdlib_sources(limit_bytes: int) -> list[str]:
    """Sorted stdlib `.py` files (tests and third-party packages excluded), up to `limit_bytes`."""
    root = Path(sysconfig.get_paths()["stdlib"])
    texts, total = [], 0
    for path in sorted(root.rglob("*.py")):
        if SKIPPED_DIRS.intersection(path.relative_to(root).parts):
            continue
        try:
            text = path.read_text(encoding="utf-8")
        except (UnicodeDecodeError, OSError):
            continue
        texts.append(text)
        total += len(text)
        if total >= limit_bytes:
            break
    return texts


def docstring_sentences(sources: list[str]) -> list[str]:
    """English sentences harvested from docstrings, used as tool and parameter descriptions."""
    sentences = []
    for text in sources:
        for block in re.findall(r'"""(.*?)"""', text, flags=re.S):
            for sentence in re.split(r"(?<=[.!?])\s+", " ".join(block.split())):
                if 20 <= len(sentence) <= 200 and sentence[0].isupper():
                    sentences.append(sentence)
    return sentences


def tool_schema(rng: random.Random, sentences: list[str]) -> dict:
    """One JSON tool definition shaped like an agent harness's (name, description, JSON schema)."""
    verbs = ["Read", "Write", "Edit", "Run", "List", "Search", "Fetch", "Create", "Update", "Delete"]
    nouns = ["File", "Task", "Notebook", "Web", "Agent", "Todo", "Shell", "Glob", "Grep", "Plan"]
    params = {}
    for _ in range(rng.randint(1, 6)):
        name = rng.choice(["file_path", "command", "pattern", "content", "old_string", "new_string", "url"])
        name = rng.choice([name, f"{name}_{rng.choice(['id', 'list', 'mode', 'limit'])}", "timeout"])
        kind = rng.choice(["string", "string", "number", "integer", "boolean", "array", "object"])
        spec: dict = {"type": kind, "description": " ".join(rng.sample(sentences, rng.randint(1, 3)))}
        if kind == "array":
            spec["items"] = {"type": "string"}
        if kind == "string" and rng.random() < 0.3:
            spec["enum"] = rng.sample(["auto", "always", "never", "read", "write", "json", "text"], 3)
        params[name] = spec
    schema = {
        "type": "object",
        "properties": params,
        "required": sorted(rng.sample(sorted(params), rng.randint(0, len(params)))),
        "additionalProperties": False,
        "$schema": "http://json-schema.org/draft-07/schema#",
    }
    description = " ".join(rng.sample(sentences, rng.randint(2, 12)))
    return {"name": rng.choice(verbs) + rng.choice(nouns), "description": description, "input_schema": schema}


def dialogue(rng: random.Random, sentences: list[str], tools: list[dict]) -> str:
    """A ChatML-like dialogue (special tokens left out) with tool calls and tool responses."""
    lines = ["system", "You are a coding agent. " + " ".join(rng.sample(sentences, 3))]
    for _ in range(rng.randint(1, 4)):
        lines += ["user", " ".join(rng.sample(sentences, 2))]
        tool = rng.choice(tools)
        args = {
            key: rng.choice(["src/main.py", "ls -la", "TODO", 3, True])
            for key in tool["input_schema"]["properties"]
        }
        call = json.dumps({"name": tool["name"], "arguments": args}, ensure_ascii=False)
        lines += ["assistant", " ".join(rng.sample(sentences, 1)), call]
        lines += ["tool", json.dumps({"output": " ".join(rng.sample(sentences, 2)), "exit_code": 0})]
    return "\n".join(lines) + "\n"


def corpus(corpus_bytes: int, seed: int = 0) -> Iterator[str]:
    """Training texts: stdlib sources, then generated tool schemas and dialogues (about 1/3 of the bytes)."""
    sources = stdlib_sources(corpus_bytes)
    yield from sources
    rng = random.Random(seed)
    sentences = docstring_sentences(sources)
    generated = 0
    while generated < corpus_bytes // 2:
        tools = [tool_schema(rng, sentences) for _ in range(rng.randint(2, 8))]
        text = json.dumps(tools, indent=rng.choice([None, 2])) + "\n"
        text += "\n".join(json.dumps({"type": "function", "function": t}) for t in tools) + "\n"
        text += dialogue(rng, sentences, tools)
        generated += len(text)
        yield text


def build(corpus_bytes: int = 12_000_000, vocab_size: int = TINY_VOCAB_SIZE) -> Tokenizer:
    """Train the byte-level BPE; special tokens get ids 0..len(TINY_SPECIAL_TOKENS)-1."""
    tokenizer = Tokenizer(models.BPE())
    tokenizer.pre_tokenizer = pre_tokenizers.Sequence(
        [
            pre_tokenizers.Split(Regex(SPLIT_PATTERN), behavior="isolated"),
            pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False),
        ]
    )
    tokenizer.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=list(TINY_SPECIAL_TOKENS),
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tokenizer.train_from_iterator(corpus(corpus_bytes), trainer=trainer)
    return tokenizer


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--out", type=Path, default=ASSETS, help="output folder")
    parser.add_argument("--corpus-mb", type=float, default=12.0, help="stdlib bytes to train on (MB)")
    opts = parser.parse_args(argv)
    tokenizer = build(int(opts.corpus_mb * 1_000_000))
    opts.out.mkdir(parents=True, exist_ok=True)
    tokenizer.save(str(opts.out / "tokenizer.json"))
    config = dict(TOKENIZER_CONFIG)
    chat_template = opts.out / "chat_template.jinja"
    if chat_template.is_file():
        config["chat_template"] = chat_template.read_text()
    (opts.out / "tokenizer_config.json").write_text(json.dumps(config, indent=2) + "\n")
    print(f"wrote {opts.out}/tokenizer.json: {tokenizer.get_vocab_size()} ids")


if __name__ == "__main__":
    main()
