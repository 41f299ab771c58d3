"""Sampling: the executor's share of a request's sampling settings, and the vectorised sampler
over a step's rows."""
