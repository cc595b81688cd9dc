"""A step's execution outcomes as metrics: how many were dropped, and why each went wrong.

    metrics.update(outcome_metrics(outcomes))   # in the driver, once per step

`dropped` counts executions left out of training; `drop_reasons` / `scored_with_issues` count the
kinds of reason (the text before the first ':'); `execution_reasons` names each execution with a
reason, so a bad execution can be found in the run's metrics.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Iterable
from typing import Any


def reason_kind(reason: str) -> str:
    """The kind of a reason: its first clause up to ':' or ';' (e.g. "harness exited with code 1")."""
    head = reason.split(";", 1)[0].split(":", 1)[0].strip()
    return head or "unknown"


def outcome_metrics(outcomes: Iterable[Any]) -> dict[str, Any]:
    """Counts and per-execution reasons of a step's outcomes (`ExecutionOutcome`s)."""
    outcomes = list(outcomes)
    dropped = [o for o in outcomes if not o.valid]
    issues = [o for o in outcomes if o.valid and getattr(o, "reason", "")]
    return {
        "dropped": len(dropped),
        "drop_reasons": dict(Counter(reason_kind(o.reason or o.detail) for o in dropped)),
        "scored_with_issues": dict(Counter(reason_kind(o.reason) for o in issues)),
        "execution_reasons": {o.execution_id: o.reason or o.detail for o in dropped + issues},
    }
