"""Why a model cannot be served, said once at start rather than discovered by every request."""

from __future__ import annotations


class UnsupportedModel(Exception):
    """The executor cannot run this model correctly; it refuses to start."""

    def __init__(self, model_type: str, reason: str) -> None:
        super().__init__(f"model type {model_type!r} cannot be served: {reason}")
        self.model_type = model_type
        self.reason = reason


def check_config(model_type: str, config: object) -> None:
    """Refuses what the config alone shows the executor cannot serve: attention that is not
    causal self-attention over the sequence's own tokens."""
    if getattr(config, "is_encoder_decoder", False):
        raise UnsupportedModel(
            model_type, "it is an encoder-decoder model: its decoder attends over encoder states"
        )
