"""Triton's dynamic batcher: per-model request queues that form batches for the model's instances."""
