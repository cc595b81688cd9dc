"""Discrete-event simulation of whole training runs driving the scheduling policies; see docs/scheduling.md."""
