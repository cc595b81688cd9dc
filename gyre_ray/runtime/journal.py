"""The scheduler's journal: the little a restarted scheduler actor cannot rebuild from the cells and the store.

    journal = RunJournal.begin(run_dir, header, v)  # a run starts at version v: the file starts afresh
    journal.launched(exec_id, cell, at_s=t, ...)    # an execution's harness was handed to `workers`
    journal.ended(exec_id, outcome.to_dict(), t)    # its outcome came back
    journal.published(batch, version, metrics)      # update `batch` is published at `version`
    journal.fault(event); journal.group_stats(stats) # a cell lost; a group's per-execution figures
    journal.clock(wall)                             # the run's clock reads 0 at time.time() == wall
    state = RunJournal.replay(run_dir, header)      # a restarted actor: None unless the same run
    state = RunJournal.read(run_dir)                # the last journaled run, whichever it is (a resume)
    call = RunJournal.unfinished_call(run_dir, ns)  # a restarted actor with no driver: what to resume

One JSON object per line in `<run_dir>/scheduler-journal.jsonl`, appended and flushed at each event
(the scheduler's process dying loses nothing written; a torn last line is ignored on replay). The
header names the run (`steps`, `first_step`, `tag`), so a restarted actor only replays its own run.
Everything else is rebuilt: records from the store, micro-batches from the records, roles and
versions from the cells (`gyre_ray.runtime.reattach`). A launch and an end also carry what the
execution's `trace.jsonl` row needs (its time on the recorder's clock, id, group, step, start version),
so a resume recovers the rows of a segment killed before it wrote its trace
(`gyre_ray.resume.lost_trace_rows`); journals written before those fields replay all the same.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from gyre_ray.json_values import is_number
from gyre_ray.proxy.store_files import json_lines

JOURNAL_NAME = "scheduler-journal.jsonl"
_LAUNCH_FACTS = ("at_s", "execution_id", "group", "step", "version")  # a `launched` event's trace facts


@dataclass
class JournalState:
    """What a journal says of its run: executions launched (-> cell), ended (-> outcome), steps published."""

    header: dict[str, Any]
    start_version: int = 0
    launched: dict[int, int] = field(default_factory=dict)
    outcomes: dict[int, dict[str, Any]] = field(default_factory=dict)
    published: list[dict[str, Any]] = field(default_factory=list)  # {"batch", "version", "metrics"}
    faults: list[dict[str, Any]] = field(default_factory=list)  # cell losses, as the summary lists them
    exec_stats: dict[str, dict[str, Any]] = field(default_factory=dict)  # per execution, from its group
    # a launch's trace facts (`at_s`, `execution_id`, `group`, `step`, `version`) and an end's time, on
    # the recorder's clock: absent from journals written before launches and ends carried them
    launches: dict[int, dict[str, Any]] = field(default_factory=dict)
    ended_at: dict[int, float] = field(default_factory=dict)
    runners: dict[int, int] = field(default_factory=dict)  # the runner actor of each (agents.runners > 0)
    runner_losses: list[dict[str, Any]] = field(default_factory=list)  # executions started again (runners)
    clock_wall: float | None = None  # time.time() at the run clock's 0 (a restarted actor goes on with it)

    @property
    def last_publish_s(self) -> float:
        """When the journaled segment last published an update, on its clock (0.0 before any)."""
        times = [
            row["metrics"].get("published_at_s") for row in self.published if isinstance(row["metrics"], dict)
        ]
        return max([float(t) for t in times if is_number(t)], default=0.0)


class RunJournal:
    """Append-only event lines of one run (see the module docstring)."""

    def __init__(self, path: Path) -> None:
        self.path = path
        self._fh = open(path, "a", encoding="utf-8")  # noqa: SIM115 (open for the run's life)

    @classmethod
    def begin(
        cls, run_dir: str | Path, header: dict[str, Any], version: int, call: dict[str, Any] | None = None
    ) -> RunJournal:
        """A new run starting at policy `version`: truncate the journal and write its header, then
        `call` (the actor's `run` call: {"namespace", "steps", "options"}) for `unfinished_call`."""
        path = Path(run_dir) / JOURNAL_NAME
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text("", encoding="utf-8")
        journal = cls(path)
        journal._write({"run": header, "version": version})
        if call is not None:
            journal._write({"call": call})
        return journal

    @staticmethod
    def unfinished_call(run_dir: str | Path, namespace: str) -> dict[str, Any] | None:
        """The `run` call of the journaled run when it belongs to the runtime in Ray namespace
        `namespace` and has steps left to publish; else None (a restarted scheduler actor resumes
        that call by itself: `SchedulerActor`)."""
        header: dict[str, Any] | None = None
        call: dict[str, Any] | None = None
        published = -1
        for event in json_lines(Path(run_dir) / JOURNAL_NAME):
            if "run" in event:
                header, call, published = event["run"], None, -1
            elif "call" in event:
                call = event["call"]
            elif "published" in event:
                published = max(published, int(event["published"]))
        if header is None or call is None or call.get("namespace") != namespace:
            return None
        return call if published + 1 < int(header["steps"]) else None

    @classmethod
    def resume(cls, run_dir: str | Path) -> RunJournal:
        """Go on appending to the journal a restarted actor replayed."""
        return cls(Path(run_dir) / JOURNAL_NAME)

    @staticmethod
    def replay(run_dir: str | Path, header: dict[str, Any]) -> JournalState | None:
        """The state of the journaled run if it is the run `header` names; else None."""
        state = RunJournal.read(run_dir)
        return state if state is not None and state.header == header else None

    @staticmethod
    def read(run_dir: str | Path) -> JournalState | None:
        """The state of the run the journal holds (the last one begun); None without one."""
        state: JournalState | None = None
        for event in json_lines(Path(run_dir) / JOURNAL_NAME):  # up to a line torn by the writer's death
            if "run" in event:
                state = JournalState(event["run"], int(event.get("version", 0)))
            elif state is None:
                return None
            elif "launched" in event:
                exec_id = int(event["launched"])
                state.launched[exec_id] = int(event["cell"])
                if all(k in event for k in _LAUNCH_FACTS):
                    state.launches[exec_id] = {k: event[k] for k in _LAUNCH_FACTS}
                if "runner" in event:
                    state.runners[exec_id] = int(event["runner"])
            elif "runner_lost" in event:
                state.runner_losses.append(event["runner_lost"])
            elif "ended" in event:
                state.outcomes[int(event["ended"])] = event["outcome"]
                if isinstance(event.get("at_s"), (int, float)):
                    state.ended_at[int(event["ended"])] = float(event["at_s"])
            elif "clock" in event:
                state.clock_wall = float(event["clock"])
            elif "fault" in event:
                state.faults.append(event["fault"])
            elif "group_stats" in event:
                state.exec_stats.update(event["group_stats"])
            elif "published" in event:
                state.published.append(
                    {"batch": event["published"], "version": event["version"], "metrics": event["metrics"]}
                )
        return state

    def launched(
        self,
        exec_id: int,
        cell: int,
        *,
        at_s: float | None = None,
        execution_id: str | None = None,
        group: str | None = None,
        step: int | None = None,
        version: int | None = None,
        runner: int | None = None,
    ) -> None:
        """Execution `exec_id` handed to `workers` (or to runner actor `runner`) for `cell`; with its
        trace facts: launched at `at_s` (the recorder's clock), `execution_id`, `group` (the trace's
        task), `step` and the policy `version` it starts with."""
        facts = zip(_LAUNCH_FACTS, (at_s, execution_id, group, step, version), strict=True)
        where = {} if runner is None else {"runner": runner}
        self._write({"launched": exec_id, "cell": cell, **{k: v for k, v in facts if v is not None}, **where})

    def runner_lost(self, loss: dict[str, Any]) -> None:
        """A runner died with an execution in flight, started again as `loss` says (`RunnerRecovery`)."""
        self._write({"runner_lost": loss})

    def ended(self, exec_id: int, outcome: dict[str, Any], at_s: float | None = None) -> None:
        """Execution `exec_id`'s outcome came back at `at_s` (the recorder's clock)."""
        self._write({"ended": exec_id, "outcome": outcome, **({} if at_s is None else {"at_s": at_s})})

    def published(self, batch: int, version: int, metrics: dict[str, Any]) -> None:
        self._write({"published": batch, "version": version, "metrics": metrics})

    def clock(self, wall: float) -> None:
        """The run's clock (what every `at_s` here reads) was 0 at `time.time() == wall`."""
        self._write({"clock": wall})

    def fault(self, event: dict[str, Any]) -> None:
        self._write({"fault": event})

    def group_stats(self, executions: dict[str, dict[str, Any]]) -> None:
        """The figures of a processed group's executions (calls, tokens: the trace's columns)."""
        self._write({"group_stats": executions})

    def close(self) -> None:
        self._fh.close()

    def _write(self, event: dict[str, Any]) -> None:
        self._fh.write(json.dumps(event, default=str) + "\n")
        self._fh.flush()
