"""Turning streamed output tokens into the text a client may see, incrementally and safely.

`TextAssembler` decodes token batches as they arrive, holds back incomplete UTF-8, stops at the
first stop string (the string itself is not shown), and, when tool calls are parsed, withholds
everything from the first tool-call marker on (it becomes structured tool calls at the end). Text
that might still turn out to be the start of a stop string or marker is held until it cannot, and
trailing whitespace is held, while tool-call markers are watched, until non-whitespace follows or
the text ends (so the caller can still drop the template's separator before a tool call, which is
not part of the text: `finish()` returns just that whitespace when a marker ended the visible
text). Without markers whitespace goes out as it comes.
"""

from __future__ import annotations

from collections.abc import Callable

REPLACEMENT = "\ufffd"
MAX_UTF8_HOLD = 8  # tokens an incomplete character may span before it is emitted as is


class TextAssembler:
    """Incremental detokenizer with stop strings and tool-call hold-back."""

    def __init__(
        self,
        decode: Callable[[list[int]], str],
        stop_ids: set[int] | frozenset[int],
        stop_strings: list[str] | None = None,
        markers: list[str] | None = None,
    ) -> None:
        self.decode = decode
        self.stop_ids = stop_ids
        self.stop_strings = [s for s in stop_strings or [] if s]
        self.markers = [m for m in markers or [] if m]
        self.ids: list[int] = []
        self.text = ""  # decoded text of ids[:self._decoded_upto] (stop ids excluded)
        self._decoded_upto = 0
        self.emitted = 0  # characters of self.text already shown
        self.stop_string: str | None = None  # the stop string that ended the text, if any
        self.visible_end: int | None = None  # where shown text ends for good (stop string / marker)
        self.marker_at: int | None = None

    def feed(self, token_ids: list[int]) -> str:
        """Add tokens; return the new text that is now safe to show."""
        self.ids.extend(token_ids)
        self._decode_pending(final=False)
        return self._release(final=False)

    def finish(self) -> str:
        """No more tokens: return whatever is left to show."""
        self._decode_pending(final=True)
        return self._release(final=True)

    @property
    def stopped(self) -> bool:
        """A stop string was seen: generation should be cancelled."""
        return self.stop_string is not None

    @property
    def content(self) -> str:
        """The text before any stop string or tool-call marker."""
        end = self.visible_end if self.visible_end is not None else len(self.text)
        return self.text[:end]

    @property
    def tail(self) -> str:
        """The withheld text from the first tool-call marker on ("" when there is none)."""
        return self.text[self.marker_at :] if self.marker_at is not None else ""

    # ---- internals ----------------------------------------------------------------------------
    def _decode_pending(self, final: bool) -> None:
        if self.stop_string is not None:
            return
        pending = [t for t in self.ids[self._decoded_upto :] if t not in self.stop_ids]
        if not pending:
            self._decoded_upto = len(self.ids)
            return
        piece = self.decode(pending)
        if piece.endswith(REPLACEMENT) and not final and len(pending) < MAX_UTF8_HOLD:
            return  # an incomplete character: wait for its remaining bytes
        self.text += piece
        self._decoded_upto = len(self.ids)
        self._scan()

    def _scan(self) -> None:
        search_from = max(
            0, self.emitted - max((len(s) for s in self.stop_strings + self.markers), default=0)
        )
        if self.marker_at is None:
            hits = [p for m in self.markers if (p := self.text.find(m, search_from)) >= 0]
            if hits:
                self.marker_at = min(hits)
                self.visible_end = (
                    self.marker_at if self.visible_end is None else min(self.visible_end, self.marker_at)
                )
        if self.stop_string is None:
            best = None
            for s in self.stop_strings:
                p = self.text.find(s, search_from)
                if p >= 0 and (best is None or p < best[0]):
                    best = (p, s)
            if best is not None and (self.marker_at is None or best[0] < self.marker_at):
                self.stop_string = best[1]
                self.visible_end = best[0]
                self.text = self.text[: best[0] + len(best[1])]

    def _release(self, final: bool) -> str:
        if self.visible_end is not None:
            end = self.visible_end
        elif final:
            end = len(self.text)
        else:
            end = len(self.text) - self._partial_suffix()
        if not final and self.markers:  # trailing whitespace waits: it may precede a tool call
            end = len(self.text[:end].rstrip())
        if end <= self.emitted:
            return ""
        out = self.text[self.emitted : end]
        self.emitted = end
        return out

    def _partial_suffix(self) -> int:
        """Length of the longest suffix of the text that is a proper prefix of a stop string or marker.

        Only the places in the text's last len(s) - 1 characters that hold s's first character are
        tried, longest suffix first (called on every batch of tokens)."""
        text, longest = self.text, 0
        for s in self.stop_strings + self.markers:
            start = len(text) - min(len(s) - 1, len(text))
            at = text.find(s[0], start)
            while at != -1 and len(text) - at > longest:
                if s.startswith(text[at:]):
                    longest = len(text) - at
                    break
                at = text.find(s[0], at + 1)
        return longest
