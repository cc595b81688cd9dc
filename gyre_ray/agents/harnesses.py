"""The harnesses an execution can run: what command starts each, with which variables and HOME files.

- `toy`: the built-in OpenAI-API agent (`gyre_ray.agents.toy_agent`).
- `claude-code`: `claude -p --dangerously-skip-permissions -- PROMPT` against the proxy's Anthropic
  API. Claude Code refuses that flag as root; the sandbox runs it as an unprivileged uid of its own,
  and where the harness runs as root all the same (`isolation=none`, or `auto` without `useradd`),
  `IS_SANDBOX=1` is set (for `command` too, which may start it).
- `codex`: `codex exec ... -- PROMPT` against the proxy's Responses API, its provider written to
  `$HOME/.codex/config.toml` (retrying a 429 / 503 as Codex does by default).
- `command`: any agent CLI from `agents.command`, a list whose items may hold `{prompt}`,
  `{workspace}`, `{home}`, `{openai_base_url}`, `{anthropic_base_url}` (bare: no attribute, index,
  conversion or format spec; `{{`/`}}` for a literal brace; the first item a program name or an
  absolute path), checked when the config is loaded (`check_command_template`); the key is in its env.

Claude Code and Codex are found at `CLAUDE_CODE_BIN` / `CODEX_BIN`, else in the repo's `.cache/`
(where `make install-harnesses` puts the pinned versions), else on PATH.
"""

from __future__ import annotations

import os
import shutil
import sys
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from gyre_ray.envs.task_scoring import program_problem, template_problem

HARNESSES = ("toy", "claude-code", "codex", "command")
REPO = Path(__file__).resolve().parents[2]
KEY_VAR = "GYRE_API_KEY"
# the names `agents.command` items may hold: the keys of `command_values`, which formats them
COMMAND_PLACEHOLDERS = ("prompt", "workspace", "home", "openai_base_url", "anthropic_base_url")


@dataclass(frozen=True)
class HarnessSpec:
    """A harness ready to start: argv, extra environment, files to write under its HOME."""

    command: list[str]
    env: dict[str, str] = field(default_factory=dict)
    home_files: dict[str, str] = field(default_factory=dict)


def find_binary(env_var: str, cached: str, name: str) -> str | None:
    """An executable from `$env_var`, else the repo cache path `cached`, else PATH. A `$env_var` that
    names no executable is a FileNotFoundError: the user asked for that one, not another."""
    chosen = os.environ.get(env_var)
    if chosen:
        if not (os.path.isfile(chosen) and os.access(chosen, os.X_OK)):
            raise FileNotFoundError(f"{env_var}={chosen} is not an executable file")
        return chosen
    path = str(REPO / cached)
    if os.path.isfile(path) and os.access(path, os.X_OK):
        return path
    return shutil.which(name)


def claude_binary() -> str | None:
    return find_binary("CLAUDE_CODE_BIN", ".cache/claude/node_modules/.bin/claude", "claude")


def codex_binary() -> str | None:
    return find_binary("CODEX_BIN", ".cache/codex/node_modules/.bin/codex", "codex")


def harness_missing(harness: str) -> str | None:
    """Why `harness` cannot start on this machine (Claude Code or Codex not installed, or its
    `*_BIN` variable naming no executable), else None."""
    finders = {"claude-code": claude_binary, "codex": codex_binary}
    if harness not in finders:
        return None
    try:
        found = finders[harness]()
    except FileNotFoundError as exc:
        return str(exc)
    return None if found else _not_installed(harness)


def _not_installed(harness: str) -> str:
    name = {"claude-code": "Claude Code", "codex": "Codex"}[harness]
    return f"{name} is not installed; run: make install-harnesses"


def check_harness_here(agents: Any) -> None:
    """ConfigError when executions run on this machine (a private local Ray, no runner actors) and
    `agents.harness` cannot start here: found before any slow work, instead of every execution
    being dropped for it. On a cluster the harnesses run where Ray puts them; nothing is checked."""
    from gyre_ray.config import ConfigError

    if os.environ.get("RAY_ADDRESS") or agents.runners:
        return
    missing = harness_missing(agents.harness)
    if missing:
        raise ConfigError(f"agents.harness={agents.harness}: {missing}")


def codex_config(openai_base_url: str) -> str:
    """`$HOME/.codex/config.toml` pointing Codex at the proxy (Responses API, key in GYRE_API_KEY)."""
    return (
        'model = "policy"\nmodel_provider = "gyre"\n'
        'approval_policy = "never"\nsandbox_mode = "workspace-write"\n\n'
        "[model_providers.gyre]\n"
        'name = "gyre-ray proxy"\n'
        f'base_url = "{openai_base_url}"\n'
        f'env_key = "{KEY_VAR}"\n'
        'wire_api = "responses"\n'
        # a 429 / 503 from the proxy (a full queue, a drain, a lost replica) is retryable: Codex's
        # own defaults (4 and 5); with 0 one such answer ended the execution on a partial workspace
        "request_max_retries = 4\nstream_max_retries = 5\n"
    )


def command_values(
    prompt: str, workspace: Path, home: Path, openai_url: str, anthropic_url: str
) -> dict[str, str]:
    """What each `agents.command` placeholder becomes (its keys are `COMMAND_PLACEHOLDERS`)."""
    return {
        "prompt": prompt,
        "workspace": str(workspace),
        "home": str(home),
        "openai_base_url": openai_url,
        "anthropic_base_url": anthropic_url,
    }


def check_command_template(template: list[str]) -> list[str]:
    """`template` if its placeholders are all known and bare and its first item names a program (not
    empty, not a path relative to the execution's workspace); ValueError naming the bad item otherwise
    (said when the config is loaded, not in every execution). Whether the program is installed is
    found where it runs: an execution it cannot start is dropped as "harness could not start"."""
    problem = template_problem(template, COMMAND_PLACEHOLDERS)
    if problem:
        raise ValueError(f"agents.command {problem}")
    unstartable = program_problem(template[0], search=False) if template else None
    if unstartable:
        raise ValueError(f"agents.command item 0 {template[0]!r} {unstartable}")
    return template


def build_harness(
    harness: str,
    prompt: str,
    *,
    base_url: str,
    workspace: Path,
    home: Path,
    as_root: bool,
    template: list[str] | None = None,
    extra_args: list[str] | None = None,
) -> HarnessSpec:
    """The spec that starts `harness` on `prompt`; `as_root`: the harness will run with uid 0."""
    extra = list(extra_args or [])
    # Claude Code refuses --dangerously-skip-permissions as root unless IS_SANDBOX=1 (HARNESS-NOTES),
    # also when `agents.command` starts it
    sandbox_env = {"IS_SANDBOX": "1"} if as_root else {}
    openai_url = base_url.rstrip("/") + "/v1"
    anthropic_url = base_url.rstrip("/")
    if harness == "toy":
        return HarnessSpec([sys.executable, "-m", "gyre_ray.agents.toy_agent"])
    if harness == "claude-code":
        claude = claude_binary()
        if claude is None:
            raise FileNotFoundError(_not_installed(harness))
        # `--` before the prompt: one that starts with "-" (a markdown list) is no option, and no
        # multi-value option in `extra` takes it as a value
        return HarnessSpec(
            [claude, "-p", "--dangerously-skip-permissions", *extra, "--", prompt], sandbox_env
        )
    if harness == "codex":
        codex = codex_binary()
        if codex is None:
            raise FileNotFoundError(_not_installed(harness))
        command = [
            codex,
            "exec",
            "--skip-git-repo-check",
            "--sandbox",
            "workspace-write",
            *extra,
            "--",
            prompt,
        ]
        return HarnessSpec(command, {}, {".codex/config.toml": codex_config(openai_url)})
    if harness == "command":
        if not template:
            raise ValueError("agents.harness=command needs agents.command (a list of arguments)")
        values = command_values(prompt, workspace, home, openai_url, anthropic_url)
        return HarnessSpec(
            [part.format_map(values) for part in check_command_template(template)], sandbox_env
        )
    raise ValueError(f"unknown harness {harness!r}; known: {', '.join(HARNESSES)}")
