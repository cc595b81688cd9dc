"""Scheduling: pure policies (colocate, async, elastic) over a backend-neutral state; see docs/scheduling.md."""
