"""Elastic runtime: dual-role cells on Ray, the streaming micro-batch queue and the elastic training step."""
