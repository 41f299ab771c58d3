"""Tensor parallelism: the ranks' process group (tp_group) and how they run each plan together
(tp_steps)."""
