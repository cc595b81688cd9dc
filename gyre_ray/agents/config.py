"""Config section `agents`: which harness runs the executions, on which tasks, within what limits."""

from __future__ import annotations

from pathlib import Path
from typing import Literal

from pydantic import Field, field_validator, model_validator

from gyre_ray.configbase import Section

NAMED_TASK_SETS = ("toy", "words", "nl2repo-mini", "longtail")
WORKSPACES_DIR = "workspaces"  # <run>/workspaces/<execution>, or <run>/workspaces/eval-<step>/<execution>


class AgentSection(Section):
    """Harness, task set, the per-execution time budget and the sandbox every execution runs in."""

    harness: Literal["toy", "claude-code", "codex", "command"] = Field(
        "toy", description="Agent harness started per execution (see docs/harnesses.md)."
    )
    command: list[str] | None = Field(
        None,
        description="harness=command: the argv template; items may hold {prompt}, {workspace}, {home}, "
        "{openai_base_url}, {anthropic_base_url} (bare names only; {{ and }} for literal braces); the "
        "first item is a program name, an absolute path or {workspace}/... (it runs in the workspace).",
    )
    harness_args: list[str] = Field(
        default_factory=list,
        description="Extra arguments appended to the claude-code or codex command line "
        "(e.g. --tools Write,Bash --system-prompt '...' to shorten Claude Code's prompt).",
    )
    task_set: str = Field(
        "toy",
        description="A named task set (toy, words: a small answer space (docs/learning.md), nl2repo-mini, "
        "longtail: nl2repo-like durations 1 h -> 40 s, longtail:S: scaled 1 h -> S s) "
        "or the path of a .jsonl/.yaml task file (format in docs/harnesses.md).",
    )
    timeout_s: float = Field(
        600.0, gt=0, description="Wall-clock limit of one execution; its workspace is scored afterwards."
    )
    eval_budget_s: float = Field(
        120.0,
        gt=0,
        description="Time within which a failing evaluator is retried before the execution is dropped.",
    )
    max_parallel: int = Field(8, ge=1, description="Executions running at once.")
    runners: int = Field(
        0,
        ge=0,
        description="Actors that run the executions' harnesses: 0 runs them all in the run's `workers` actor "
        "beside the scheduler (one machine); N starts N actors `runner-0` .. `runner-<N-1>`, spread over the "
        "nodes that offer agents.runner_resources, each execution on the one running the fewest "
        "(docs/cluster.md, 'Agents on nodes of their own').",
    )
    runner_resources: dict[str, float] = Field(
        default_factory=dict,
        description="Ray resources each runner actor takes, e.g. {agents: 1} to put one on each node started "
        "with --resources '{\"agents\": 1}' (empty: any node).",
    )
    workspace_root: str | None = Field(
        None,
        description="An absolute folder on every node that runs executions (say a node-local disk) under "
        "which a run's workspaces go, as <workspace_root>/<run folder name>/workspaces/<id>; null: "
        "<run folder>/workspaces. Builds and test runs then use the node's own disk, not the run folder's "
        "shared volume (docs/cluster.md).",
    )
    isolation: Literal["auto", "user", "none"] = Field(
        "auto",
        description="user: each execution runs as an unprivileged uid of its own (needs root); none: as the "
        "job's uid; auto: user where possible, else none.",
    )
    max_processes: int = Field(
        256,
        ge=0,
        description="Processes (and threads: RLIMIT_NPROC counts both) of one execution; reaching it ends "
        "the execution as a runaway (0: no limit).",
    )
    max_memory_mb: int = Field(
        4096, ge=0, description="Resident memory of one execution's processes, MiB (0: no limit)."
    )
    max_file_mb: int = Field(
        1024, ge=0, description="Largest file an execution may write, MiB (0: no limit)."
    )
    max_disk_mb: int = Field(
        4096,
        ge=0,
        description="Disk an execution may add to its workspace, HOME and TMPDIR, MiB (0: no limit); its "
        "evaluator may add as much again.",
    )
    env_passthrough: list[str] = Field(
        default_factory=list,
        description="Names of job environment variables handed to harnesses (none of the job's by default).",
    )
    toy_turns: int = Field(2, ge=1, description="Main-agent turns of the toy harness before its retry.")
    toy_max_tokens: int = Field(16, ge=1, description="max_tokens of each toy-harness model call.")
    toy_top_p: float = Field(
        1.0,
        gt=0,
        le=1,
        description="top_p of each toy-harness model call (below 1 the rare tokens a warmed-up policy would "
        "break its tool-call format with are never sampled).",
    )

    @field_validator("runner_resources")
    @classmethod
    def _runner_resources(cls, value: dict[str, float]) -> dict[str, float]:
        for name, amount in value.items():
            if not name.strip():
                raise ValueError("a resource name is empty")
            if not amount > 0:  # (NaN too)
                raise ValueError(f"resource {name!r}: the amount must be > 0, got {amount}")
        return value

    def workspaces_dir(self, run_dir: str | Path) -> Path:
        """Where the executions of the run in `run_dir` get their workspaces (`workspace_root`)."""
        run_dir = Path(run_dir)
        base = run_dir if self.workspace_root is None else Path(self.workspace_root) / run_dir.name
        return base / WORKSPACES_DIR

    @field_validator("workspace_root")
    @classmethod
    def _workspace_root(cls, value: str | None) -> str | None:
        if value is not None and not Path(value).is_absolute():
            raise ValueError(
                f"must be an absolute path (it names a folder on every agent node), got {value!r}"
            )
        return value

    @field_validator("command")
    @classmethod
    def _command_template(cls, value: list[str] | None) -> list[str] | None:
        from gyre_ray.agents.harnesses import check_command_template

        return None if value is None else check_command_template(value)

    @field_validator("task_set")
    @classmethod
    def _task_set(cls, value: str) -> str:
        return check_task_set(value)

    @model_validator(mode="after")
    def _command_given(self) -> AgentSection:
        if self.harness == "command" and not self.command:
            raise ValueError("harness=command needs agents.command (the argv template, a list of strings)")
        if self.harness != "command" and self.command:  # it would be ignored: the harness runs instead
            raise ValueError(
                f"agents.command is used only by agents.harness=command (harness is {self.harness!r}); "
                "set agents.harness=command, or leave agents.command out (agents.command=null)"
            )
        if self.runner_resources and not self.runners:
            raise ValueError(
                "agents.runner_resources places the runner actors, but agents.runners is 0 (the executions "
                "run in the `workers` actor): set agents.runners, or leave runner_resources out"
            )
        if self.harness in ("toy", "command") and self.harness_args:
            raise ValueError(
                f"agents.harness_args is appended to the claude-code or codex command line only; harness "
                f"{self.harness!r} would ignore it"
                + (" (put the arguments in agents.command)" if self.harness == "command" else "")
            )
        return self


def check_task_set(value: str) -> str:
    """A task set name, or an existing .jsonl/.yaml task file (made absolute); ValueError otherwise."""
    if value in NAMED_TASK_SETS:
        return value
    if value.startswith("longtail:"):
        from gyre_ray.envs.longtail import parse_scale

        parse_scale(value)  # a clear error for a bad scale
        return value
    path = Path(value).expanduser()
    if path.suffix not in (".jsonl", ".yaml", ".yml"):
        raise ValueError(f"task_set must be one of {', '.join(NAMED_TASK_SETS)} or a .jsonl/.yaml file")
    if not path.is_file():
        raise ValueError(f"task file {value} does not exist")
    from gyre_ray.envs.taskfile import load_task_file

    load_task_file(path.resolve())  # its first bad line, said now: not after the cells have started
    return str(path.resolve())
