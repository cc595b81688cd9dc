"""Prompts to token ids and output ids back to text and tool calls, for the served policy.

`ChatCodec` wraps the policy's tokenizer and the ChatML chat template (`gyre_ray.model.chat_template`):
`prompt_ids` renders a `ChatPrompt` segment by segment and splices recorded output ids in place of
re-encoded assistant bodies; `parse` splits generated text into content and tool calls. Loading it
needs no torch (only the tokenizer and the model's context length), so the proxy stays light.

Harnesses re-send their whole conversation on every call (Claude Code's first request is ~76 KB,
its system prompt and tools; over 10 ms to encode here), so `prompt_ids` keeps the ids of recently rendered segments in a bounded
LRU (`SegmentCache`): a segment seen before costs a lookup instead of an encode.
"""

from __future__ import annotations

import functools
import hashlib
import json
from array import array
from collections import OrderedDict
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

from gyre_ray.model.chat_template import TOOL_CALL_OPEN, ParsedOutput, encode_chat, parse_assistant_output
from gyre_ray.model.config import ModelSection
from gyre_ray.model.tokenizer import Tokenizer
from gyre_ray.proxy.prompt import ChatPrompt

# Token ids of segment text `prompt_ids` keeps: 4 bytes each (192 MiB at most, plus 16 bytes of key and
# Python's overhead per segment), enough for the contexts of about 300 executions of 150k tokens in
# turn on one replica. Sized by ids: keyed by text, 16M characters held about 33 such contexts and
# every call past that re-encoded its whole prompt (140 ms on the event loop at 147k tokens).
SEGMENT_CACHE_IDS = 48_000_000


class SegmentCache:
    """The tokenizer with an LRU of encoded texts, keyed by a 16-byte BLAKE2b digest of the text and
    bounded by the number of ids it holds.

    Encoding is deterministic, so a hit is exactly what encoding would give (up to a digest
    collision, about 2^-64 for a billion segments). Ids are kept compactly (4 bytes each); `encode`
    returns a fresh list.
    """

    def __init__(self, tokenizer: Tokenizer, max_ids: int = SEGMENT_CACHE_IDS) -> None:
        self.tokenizer = tokenizer
        self.max_ids = max_ids
        self.ids = 0
        self.hits = 0
        self.misses = 0
        self._entries: OrderedDict[bytes, array] = OrderedDict()
        self._stop_ids = list(tokenizer.stop_ids())

    def stop_ids(self) -> list[int]:
        return list(self._stop_ids)

    def encode(self, text: str) -> list[int]:
        key = hashlib.blake2b(text.encode("utf-8", "surrogatepass"), digest_size=16).digest()
        ids = self._entries.get(key)
        if ids is not None:
            self.hits += 1
            self._entries.move_to_end(key)
            return ids.tolist()
        self.misses += 1
        encoded = self.tokenizer.encode(text)
        if len(encoded) <= self.max_ids:
            self._entries[key] = array("i", encoded)
            self.ids += len(encoded)
            while self.ids > self.max_ids:
                _, old = self._entries.popitem(last=False)
                self.ids -= len(old)
        return encoded


class ChatCodec:
    """Tokenizer + chat template + the model's context length."""

    tool_call_marker = TOOL_CALL_OPEN

    def __init__(
        self,
        tokenizer: Tokenizer,
        context_length: int,
        model_name: str = "gyre-policy",
        segment_cache_ids: int = SEGMENT_CACHE_IDS,
    ) -> None:
        self.tokenizer = tokenizer
        self.context_length = context_length
        self.model_name = model_name
        self.stop_ids = frozenset(tokenizer.stop_ids())
        self.vocab_size = tokenizer.vocab_size
        self.segments = SegmentCache(tokenizer, segment_cache_ids)

    @classmethod
    def for_model(cls, section: ModelSection) -> ChatCodec:
        """The codec of the policy a `model` config section describes (tokenizer and context length)."""
        from gyre_ray.model.arch import ModelArgs

        if section.path:
            folder = Path(section.path)
            args = ModelArgs.from_hf_config(json.loads((folder / "config.json").read_text()))
            tokenizer = (
                Tokenizer.from_folder(folder)
                if (folder / "tokenizer.json").is_file()
                else Tokenizer.default()
            )
            name = folder.name
        else:
            args = ModelArgs.preset(section.preset)
            tokenizer = Tokenizer.default()
            name = f"gyre-{section.preset}"
        return cls(tokenizer, args.max_position_embeddings, name)

    def encode(self, text: str) -> list[int]:
        return self.tokenizer.encode(text)

    def decode(self, ids: Sequence[int]) -> str:
        return self.tokenizer.decode(ids)

    def prompt_ids(
        self, prompt: ChatPrompt, assistant_tokens: Mapping[int, Sequence[int]] | None = None
    ) -> list[int]:
        """ChatML prompt ids with the generation prompt; `assistant_tokens[i]` replaces message i's body."""
        return encode_chat(
            self.segments,  # type: ignore[arg-type]  # encode_chat needs only encode() and stop_ids()
            prompt.messages,
            prompt.tools or None,
            add_generation_prompt=True,
            assistant_tokens=assistant_tokens,
            token_limit=(self.context_length, self.longest_token_chars),
        )

    @functools.cached_property
    def longest_token_chars(self) -> int:
        """The most characters of a prompt's text one token can stand for: the vocabulary's longest
        token (a byte-level token spells one character per byte), times 4 where the tokenizer
        normalizes first (NFC and the like compose a few code points into one)."""
        backend = self.tokenizer.backend
        longest = max((len(token) for token in backend.get_vocab(with_added_tokens=True)), default=1)
        return longest * (4 if backend.normalizer is not None else 1)

    def parse(self, text: str) -> ParsedOutput:
        """Content and tool calls of generated text (malformed tool calls stay in the content)."""
        return parse_assistant_output(text)

    def check_ids(self, ids: Sequence[Any]) -> list[int]:
        """Token ids given by a client: integers in [0, vocab_size), else ValueError naming the first bad one."""
        out = []
        for pos, tok in enumerate(ids):
            if isinstance(tok, bool) or not isinstance(tok, int) or not 0 <= tok < self.vocab_size:
                raise ValueError(f"prompt[{pos}] = {tok!r} is not a token id in [0, {self.vocab_size})")
            out.append(tok)
        return out
