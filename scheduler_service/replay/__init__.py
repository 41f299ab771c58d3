"""Replays a step trace (--trace-dir) through the real scheduler core against the simulated
executor, under the recorded configuration or others; draws queues and batches over time."""
