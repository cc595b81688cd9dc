"""Role classifier for calls recorded as `unknown`: prompt markers first, then the shape of the tree.

Rules, in order (documented in docs/trajectory.md):

1. **Threads.** Calls linked by continuation (a call's prompt extends an earlier call's prompt +
   output, see `CallTree.continues`) form a thread: one agent's conversation, retries included.
2. **Markers** (only with a `decode` function). A summary marker (e.g. Claude Code's compaction
   instruction) in the first or last `marker_window_chars` of a call's decoded prompt makes it a
   summary call; a sub-agent marker (e.g. "You are an agent for Claude Code") in the first window
   makes its whole thread a sub-agent thread.
3. **Seeds.** A thread's first call is *seeded* by an earlier call when that call's whole output
   (>= `min_seed_tokens` tokens; or all but its first and last token, which re-encoding may merge
   with their neighbours; or its decoded text) appears inside the new prompt. A call that no later
   call continues and whose output seeds a later thread is a summary (a compaction), unless the
   new prompt holds that output right after the end of the call's own prompt (then the new prompt
   re-renders the history, as a compaction request with its own system prompt does), or unless
   that output was handed back into a running conversation (it appears in what a continuing call
   appends to its parent's prompt: a sub-agent's answer returned as a tool result).
4. **Thread roles.** Records with a known role vote for their thread. Otherwise the thread of the
   execution's first call is `main`, and so is a thread opening with that call's whole prompt (a
   restart); a thread seeded by a summary, or itself a summary of an
   earlier thread, inherits that thread's role (compaction keeps the agent); any other thread is a
   `sub-agent`. A summary call, and any abandoned attempt with the same prompt, gets
   `<thread role>-summary`.
"""

from __future__ import annotations

from array import array
from collections import Counter
from collections.abc import Callable

from gyre_ray.trajectory.config import TrajectorySection
from gyre_ray.trajectory.records import CallRecord
from gyre_ray.trajectory.tree import CallTree, Decode

# A seed preceded in the new prompt by this many tokens of its own call's prompt is history, not a summary.
HISTORY_TOKENS = 4
ROLE_PRIORITY = {"main": 0, "main-summary": 1, "sub-agent": 2, "sub-agent-summary": 3}


def base_role(role: str) -> str:
    """`main` or `sub-agent` for a known role ('' for `unknown`)."""
    return "" if role == "unknown" else role.removesuffix("-summary")


def _as_bytes(ids: list[int]) -> bytes:
    return array("I", ids).tobytes()


def _prompt_key(call: CallRecord) -> tuple[int, int]:
    return len(call.input_ids), hash(_as_bytes(call.input_ids))


def _contains(haystack: bytes, needle: bytes) -> bool:
    """Token-aligned containment of one id sequence in another (4 bytes per id)."""
    start = haystack.find(needle)
    while start >= 0:
        if start % 4 == 0:
            return True
        start = haystack.find(needle, start + 1)
    return False


def _has_marker(text: str, markers: list[str]) -> bool:
    lowered = text.lower()
    return any(m.lower() in lowered for m in markers if m)


def _threads(tree: CallTree) -> list[int]:
    """Per call: the index of the first call of its thread."""
    thread = list(range(len(tree.calls)))
    opening: dict[bytes, int] = {}
    for i, prev in enumerate(tree.continues):
        if prev is not None:
            thread[i] = thread[prev]
            continue
        key = _as_bytes(tree.calls[i].input_ids)
        if key in opening:  # a retry of an opening call joins the first attempt's thread
            thread[i] = thread[opening[key]]
        opening.setdefault(key, i)
    return thread


class _SeedFinder:
    """Does an earlier call's whole output appear in a later prompt (as tokens, or as decoded text)?"""

    def __init__(self, tree: CallTree, min_tokens: int, decode: Decode | None) -> None:
        self.calls, self.min_tokens, self.decode = tree.calls, min_tokens, decode
        self.parents = tree.continues
        self._bytes: dict[int, bytes] = {}
        self._text: dict[int, str] = {}
        self._appended_ids: dict[int, bytes] = {}  # per continuing call: what it adds to its parent's prompt
        self._appended_texts: dict[int, str] = {}

    def _prompt_bytes(self, h: int) -> bytes:
        if h not in self._bytes:
            self._bytes[h] = _as_bytes(self.calls[h].input_ids)
        return self._bytes[h]

    def _prompt_text(self, h: int) -> str:
        if h not in self._text:
            self._text[h] = self.decode(self.calls[h].input_ids) if self.decode else ""
        return self._text[h]

    def seeds(self, h: int, candidates: list[int]) -> list[int]:
        """The candidates whose output appears in call h's prompt."""
        return [c for c in candidates if self._appears(self.calls[c].output_ids, h)]

    def in_context(self, h: int, c: int) -> bool:
        """Whether call h's prompt re-renders call c's own turn: c's prompt end directly precedes its
        output there (a history holding c's turn; a sub-agent's answer handed back as a tool result
        is not one)."""
        call = self.calls[c]
        return _contains(self._prompt_bytes(h), _as_bytes(call.input_ids[-HISTORY_TOKENS:] + call.output_ids))

    def summaries(self, h: int, candidates: list[int]) -> list[int]:
        """Seeds of h that appear without their own turn's context: h holds their output, not a
        re-rendered history in which the call's prompt end directly precedes its output."""
        return [c for c in self.seeds(h, candidates) if not self.in_context(h, c)]

    def returned(self, c: int, continuations: list[int]) -> bool:
        """Was call c's output handed back into a running conversation, i.e. does it appear in the
        part that one of `continuations` (calls continuing an earlier call) appends to its parent's
        prompt? A sub-agent's answer comes back to its caller that way, as a tool result; a
        compaction summary opens a new conversation instead."""
        out = self.calls[c].output_ids
        return any(
            self._appears_in(out, self._appended_bytes(j), lambda j=j: self._appended_text(j))
            for j in continuations
            if j > c
        )

    def _appended(self, j: int) -> list[int]:
        return self.calls[j].input_ids[len(self.calls[self.parents[j]].input_ids) :]

    def _appended_bytes(self, j: int) -> bytes:
        if j not in self._appended_ids:
            self._appended_ids[j] = _as_bytes(self._appended(j))
        return self._appended_ids[j]

    def _appended_text(self, j: int) -> str:
        if j not in self._appended_texts:
            self._appended_texts[j] = self.decode(self._appended(j)) if self.decode else ""
        return self._appended_texts[j]

    def _appears(self, out: list[int], h: int) -> bool:
        return self._appears_in(out, self._prompt_bytes(h), lambda: self._prompt_text(h))

    def _appears_in(self, out: list[int], haystack: bytes, text: Callable[[], str]) -> bool:
        if len(out) < self.min_tokens:
            return False
        # Whole output, or without its first and last token (a stop token, or tokens merged with
        # their neighbours when the harness re-encoded the text).
        needles = [out] + ([out[1:-1]] if len(out) - 2 >= self.min_tokens else [])
        if any(_contains(haystack, _as_bytes(n)) for n in needles):
            return True
        if self.decode is None:
            return False
        found = text()
        return any(piece and piece in found for piece in (self.decode(n).strip() for n in needles))


def classify_roles(
    tree: CallTree, cfg: TrajectorySection | None = None, decode: Decode | None = None
) -> list[str]:
    """One role per call of `tree.calls` (same order), with every `unknown` resolved."""
    cfg = cfg or TrajectorySection()
    decode = decode if decode is not None else tree.decode
    calls = tree.calls
    roles = [c.role for c in calls]
    if "unknown" not in roles:
        return roles
    n = len(calls)
    thread = _threads(tree)
    continued = {p for p in tree.continues if p is not None}

    is_summary = [r.endswith("-summary") for r in roles]
    sub_mark_threads: set[int] = set()
    if decode is not None:
        w = cfg.marker_window_chars
        for i, call in enumerate(calls):
            if call.role != "unknown" or not w:
                continue
            text = decode(call.input_ids)
            head, tail = text[:w], text[-w:]
            if _has_marker(head, cfg.summary_markers) or _has_marker(tail, cfg.summary_markers):
                is_summary[i] = True
            if _has_marker(head, cfg.subagent_markers):
                sub_mark_threads.add(thread[i])

    # A call nobody continues whose output seeds a later thread is a compaction summary.
    heads = [i for i in range(n) if thread[i] == i]
    finder = _SeedFinder(tree, cfg.min_seed_tokens, decode)
    sources = {h: finder.summaries(h, [c for c in range(h) if c not in continued]) for h in heads[1:]}
    continuations = [i for i in range(n) if tree.continues[i] is not None]
    handed_back = {c for found in sources.values() for c in found if finder.returned(c, continuations)}
    sources = {h: [c for c in found if c not in handed_back] for h, found in sources.items()}
    for found in sources.values():
        for c in found:
            is_summary[c] = is_summary[c] or roles[c] == "unknown"
    # An abandoned attempt of a summary call (same prompt) is a summary too.
    summary_prompts = {_prompt_key(calls[i]) for i in range(n) if is_summary[i]}
    for i in range(n):
        if roles[i] == "unknown" and not is_summary[i] and _prompt_key(calls[i]) in summary_prompts:
            is_summary[i] = True

    opening = calls[heads[0]].input_ids
    thread_role: dict[int, str] = {}
    for h in heads:
        votes = Counter(base_role(roles[i]) for i in range(n) if thread[i] == h and roles[i] != "unknown")
        if votes:
            thread_role[h] = votes.most_common(1)[0][0]
        elif h in sub_mark_threads:
            thread_role[h] = "sub-agent"
        elif h == heads[0] or calls[h].input_ids[: len(opening)] == opening:
            thread_role[h] = "main"  # the first thread, or a restart with the same opening prompt
        else:
            owner = [c for c in sources.get(h, []) if is_summary[c]]
            if not owner and is_summary[h]:  # a compaction with its own prompt: whose history is it?
                # the latest call whose own turn it re-renders (a sub-agent's answer, handed back as a
                # tool result just before, is the latest output in it, but not its history)
                seeds = finder.seeds(h, list(range(h)))
                owner = [c for c in seeds if finder.in_context(h, c)] or seeds
            thread_role[h] = thread_role[thread[owner[-1]]] if owner else "sub-agent"
    return [
        thread_role[thread[i]] + ("-summary" if is_summary[i] else "") if role == "unknown" else role
        for i, role in enumerate(roles)
    ]
