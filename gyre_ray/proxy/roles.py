"""Which branch of an execution's tree a call belongs to: main, sub-agent, or a summary of either.

An `X-Gyre-Role` header decides when present. Otherwise per-harness rules read the prompt:
- Claude Code (user agent `claude-cli/...`): a sub-agent (its Agent tool) sends `cc_is_subagent=true`
  in the `x-anthropic-billing-header` line of its system prompt (older versions introduce it as
  "an agent for Claude Code"); a compaction call asks for a detailed summary of the conversation.
- Codex (`x-codex-turn-metadata` header, JSON): a `request_kind` naming a compaction makes the call
  a summary; an `agent_name` other than the main agent's makes it a sub-agent's (`codex_role`).
- Any harness: the first system prompt an execution sends is its main one; a call with another
  system prompt is a sub-agent; a call whose last user turn asks for a conversation summary is a
  summary of the branch it would otherwise belong to. A summary request with a system prompt of its
  own is `unknown`: a harness may compact its main conversation with a summariser prompt as well as
  a sub-agent's, so the record's tree decides whose history it summarises (docs/trajectory.md).
"""

from __future__ import annotations

import hashlib
import json
import re

from gyre_ray.proxy.prompt import ChatPrompt
from gyre_ray.trajectory.records import ROLES

HEADER = "x-gyre-role"
CLAUDE_CODE_SUBAGENT = re.compile(r"cc_is_subagent=true|you are an agent for claude code", re.IGNORECASE)
BILLING_HEADER = re.compile(r"^x-anthropic-billing-header:.*$", re.MULTILINE)
CLAUDE_CODE_MARKER = re.compile(r"claude code|claude-cli", re.IGNORECASE)
SUMMARY_REQUEST = re.compile(
    r"(detailed|concise|brief)?\s*summary of (the|this|our) (conversation|session|work)"
    r"|summari[sz]e (the|this|our) (conversation|session|work|context)"
    r"|compact(ed|ion)? (the )?(conversation|context)",
    re.IGNORECASE,
)


class RoleError(ValueError):
    """An X-Gyre-Role header naming no known role."""


def system_text(prompt: ChatPrompt) -> str:
    """All system text of a prompt, in order."""
    return "\n".join(m.get("content") or "" for m in prompt.messages if m["role"] == "system")


def system_fingerprint(prompt: ChatPrompt) -> str:
    """A short hash of the prompt's first system message (empty string when there is none).

    Per-request header lines (Claude Code's `x-anthropic-billing-header`) are left out.
    """
    first = next((m.get("content") or "" for m in prompt.messages if m["role"] == "system"), "")
    first = BILLING_HEADER.sub("", first).strip()
    return hashlib.sha1(first.encode("utf-8", "replace")).hexdigest()[:16] if first else ""


def _last_user_text(prompt: ChatPrompt) -> str:
    for message in reversed(prompt.messages):
        if message["role"] == "user":
            return message.get("content") or ""
    return ""


def classify_role(
    prompt: ChatPrompt,
    header: str | None = None,
    user_agent: str = "",
    main_fingerprint: str | None = None,
) -> str:
    """The call's role. `main_fingerprint` is the execution's first system fingerprint (None: this is it)."""
    if header is not None and header.strip():
        role = header.strip().lower()
        if role not in ROLES:
            raise RoleError(f"X-Gyre-Role {header!r} is not one of {', '.join(ROLES)}")
        return role
    system = system_text(prompt)
    summary = bool(SUMMARY_REQUEST.search(_last_user_text(prompt)[-20000:]))
    claude_code = bool(CLAUDE_CODE_MARKER.search(user_agent)) or bool(
        CLAUDE_CODE_MARKER.search(system[:2000])
    )
    if claude_code:
        sub_agent = bool(CLAUDE_CODE_SUBAGENT.search(system[:4000]))
    else:
        fingerprint = system_fingerprint(prompt)
        sub_agent = main_fingerprint is not None and fingerprint != main_fingerprint
        if sub_agent and summary:
            return "unknown"  # main's or a sub-agent's compaction with its own prompt: the tree decides
    base = "sub-agent" if sub_agent else "main"
    return f"{base}-summary" if summary else base


CODEX_MAIN_AGENTS = {"", "main", "default", "root"}  # Codex 0.171 names its main agent "/root"


def codex_role(headers: dict[str, str]) -> str | None:
    """A role from Codex's `x-codex-turn-metadata` header, or None when it says nothing decisive
    (then the generic rules apply). `headers` has lower-case names."""
    raw = headers.get("x-codex-turn-metadata")
    if not raw:
        return None
    try:
        meta = json.loads(raw)
    except (ValueError, RecursionError):
        return None
    if not isinstance(meta, dict):
        return None
    kind = str(meta.get("request_kind") or "").lower()
    agent = str(meta.get("agent_name") or "").lower().strip("/")
    summary = "compact" in kind or "summar" in kind
    sub_agent = agent not in CODEX_MAIN_AGENTS
    if not (summary or sub_agent):
        return None
    return ("sub-agent" if sub_agent else "main") + ("-summary" if summary else "")
