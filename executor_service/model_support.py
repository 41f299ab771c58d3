"""Why a model cannot be served, said once at start rather than discovered by every request."""

from __future__ import annotations


class UnsupportedModel(Exception):
    """The executor cannot run this model correctly; it refuses to start."""

    def __init__(self, model_type: str, reason: str) -> None:
        super().__init__(f"model type {model_type!r} cannot be served: {reason}")
        self.model_type = model_type
        self.reason = reason
