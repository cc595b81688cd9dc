"""Trainers: the `Trainer` interface, the torch trainer, micro-batches and the backend factory."""
