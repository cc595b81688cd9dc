"""Rollout engines: the `RolloutEngine` interface, the torch engine and the backend factory."""
