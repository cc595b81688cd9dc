"""Checks of single JSON values read back from run files (records, metrics, checkpoints, summaries),
shared by the readers that refuse or note a value the job never writes."""

from __future__ import annotations

import json
import math
from typing import Any


def is_int(value: Any) -> bool:
    """An `int` that is not a bool (JSON integers)."""
    return isinstance(value, int) and not isinstance(value, bool)


def is_number(value: Any) -> bool:
    """A finite JSON number (not a bool; NaN and infinity, which Python's json reads, are no figure)."""
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        return False
    return isinstance(value, int) or math.isfinite(value)


def short(value: Any) -> str:
    """`value` as JSON, cut to 40 characters (a value from a run file, in a message)."""
    text = json.dumps(value)
    return text if len(text) <= 40 else text[:37] + "..."


def finite_float(text: str) -> float:
    """`json.loads`'s `parse_float` refusing a number beyond float range (ValueError): JSON cannot
    hold the infinity Python would read it as, so it could not be written back."""
    value = float(text)
    if not math.isfinite(value):
        raise ValueError(f"the number {text[:40]} is out of range")
    return value


def reject_constant(name: str) -> Any:
    """`json.loads`'s `parse_constant`: NaN, Infinity and -Infinity are not JSON (ValueError)."""
    raise ValueError(f"{name} is not valid JSON")
