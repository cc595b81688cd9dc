"""Tokenizer of the policy: a thin wrapper over a Hugging Face `tokenizers.Tokenizer` (tokenizer.json).

`Tokenizer.default()` is the tiny byte-level BPE shipped in `assets/` (built by build_tokenizer.py),
whose special-token ids match `ModelArgs.tiny()`. `Tokenizer.from_folder(path)` reads any local HF
folder: `tokenizer.json`, plus `tokenizer_config.json` (eos / pad tokens, `chat_template`) and a
`chat_template.jinja` file when present.

Text is encoded as HF does: a special token's literal text (e.g. "<|im_end|>") inside `text`
becomes that special id, which is how rendered ChatML is turned into ids.
"""

from __future__ import annotations

import functools
import json
from collections.abc import Iterable
from pathlib import Path
from typing import Any

import tokenizers

ASSETS = Path(__file__).resolve().parent / "assets"
TOKENIZER_FILE = "tokenizer.json"
TOKENIZER_CONFIG_FILE = "tokenizer_config.json"
CHAT_TEMPLATE_FILE = "chat_template.jinja"


def _token_text(value: Any) -> str | None:
    """tokenizer_config.json holds a token as a string or as {"content": ...}."""
    if isinstance(value, dict):
        return value.get("content")
    return value if isinstance(value, str) else None


class Tokenizer:
    """Encode/decode text and name the ids of the chat special tokens."""

    def __init__(self, backend: tokenizers.Tokenizer, config: dict[str, Any] | None = None, name: str = ""):
        self.backend = backend
        self.config = dict(config or {})
        self.name = name
        added = backend.get_added_tokens_decoder()
        self._special_ids = frozenset(i for i, token in added.items() if token.special)

    # ----------------------------------------------------------------- construction
    @classmethod
    @functools.cache
    def default(cls) -> Tokenizer:
        """The tiny default tokenizer shipped with gyre-ray (8192 ids, byte-level BPE)."""
        return cls.from_folder(ASSETS, name="gyre-ray-tiny")

    @classmethod
    def from_folder(cls, path: str | Path, name: str | None = None) -> Tokenizer:
        """Load `path/tokenizer.json` with the optional `tokenizer_config.json` / `chat_template.jinja`."""
        folder = Path(path)
        if not (folder / TOKENIZER_FILE).is_file():
            raise FileNotFoundError(f"no {TOKENIZER_FILE} in tokenizer folder {folder}")
        backend = tokenizers.Tokenizer.from_file(str(folder / TOKENIZER_FILE))
        config: dict[str, Any] = {}
        if (folder / TOKENIZER_CONFIG_FILE).is_file():
            config = json.loads((folder / TOKENIZER_CONFIG_FILE).read_text())
        if (folder / CHAT_TEMPLATE_FILE).is_file() and not config.get("chat_template"):
            config["chat_template"] = (folder / CHAT_TEMPLATE_FILE).read_text()
        return cls(backend, config, name=name if name is not None else folder.name)

    def save(self, folder: str | Path) -> None:
        """Write `tokenizer.json` and `tokenizer_config.json` (with the chat template) into `folder`."""
        folder = Path(folder)
        folder.mkdir(parents=True, exist_ok=True)
        self.backend.save(str(folder / TOKENIZER_FILE))
        (folder / TOKENIZER_CONFIG_FILE).write_text(json.dumps(self.config, indent=2) + "\n")

    # ----------------------------------------------------------------- text <-> ids
    def encode(self, text: str, add_special_tokens: bool = False) -> list[int]:
        """Token ids of `text`; special-token literals in `text` become their single ids."""
        return self.backend.encode(text, add_special_tokens=add_special_tokens).ids

    def encode_batch(self, texts: list[str], add_special_tokens: bool = False) -> list[list[int]]:
        return [e.ids for e in self.backend.encode_batch(texts, add_special_tokens=add_special_tokens)]

    def decode(self, ids: Iterable[int], skip_special_tokens: bool = False) -> str:
        """Text of `ids` (byte-level BPE: exact inverse of `encode` for whole sequences)."""
        ids = list(ids)
        bad = [i for i in ids if not 0 <= i < self.vocab_size]
        if bad:
            raise ValueError(f"token ids {bad[:5]} are outside the vocabulary [0, {self.vocab_size})")
        return self.backend.decode(ids, skip_special_tokens=skip_special_tokens)

    def token_to_id(self, token: str) -> int | None:
        return self.backend.token_to_id(token)

    def id_to_token(self, token_id: int) -> str | None:
        return self.backend.id_to_token(token_id)

    # ----------------------------------------------------------------- vocabulary facts
    @property
    def vocab_size(self) -> int:
        """Number of ids the tokenizer can produce (added tokens included)."""
        return self.backend.get_vocab_size(with_added_tokens=True)

    @property
    def special_ids(self) -> frozenset[int]:
        """Ids of all special (added, never merged) tokens."""
        return self._special_ids

    @property
    def chat_template(self) -> str | None:
        """The folder's Jinja chat template, if it ships one."""
        return self.config.get("chat_template") or None

    def _first_known(self, *tokens: str | None) -> int | None:
        for token in tokens:
            if token is not None and (token_id := self.token_to_id(token)) is not None:
                return token_id
        return None

    @property
    def eos_id(self) -> int | None:
        """End of a model turn: the config's eos_token, else <|im_end|>, else <|endoftext|>."""
        return self._first_known(_token_text(self.config.get("eos_token")), "<|im_end|>", "<|endoftext|>")

    @property
    def pad_id(self) -> int | None:
        """Padding id: the config's pad_token, else <|endoftext|>, else eos."""
        found = self._first_known(_token_text(self.config.get("pad_token")), "<|endoftext|>")
        return found if found is not None else self.eos_id

    @property
    def bos_id(self) -> int | None:
        return self._first_known(_token_text(self.config.get("bos_token")))

    @property
    def im_start_id(self) -> int | None:
        return self.token_to_id("<|im_start|>")

    @property
    def im_end_id(self) -> int | None:
        return self.token_to_id("<|im_end|>")

    def stop_ids(self) -> list[int]:
        """Ids that end an assistant turn: eos and, when present, <|im_end|> and <|endoftext|>."""
        ids = [self.eos_id, self.im_end_id, self.token_to_id("<|endoftext|>")]
        return sorted({i for i in ids if i is not None})

    def __repr__(self) -> str:
        return f"Tokenizer({self.name!r}, vocab_size={self.vocab_size})"
