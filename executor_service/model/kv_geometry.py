"""The K/V geometry a model's attention layers really use, measured by one tiny forward.

Configs describe heads and widths in many ways (multi-query flags, latent-attention ranks, head
widths that differ for keys and values); the tensors attention is handed do not. One forward of a
few tokens, run without a cache, records per layer the K/V heads and widths our attention
receives, and the paged cache is shaped from that.
"""

from __future__ import annotations

import torch
from transformers import PreTrainedModel

from executor_service.attention.paged_attention import (
    LayerGeometry,
    ProbedLayer,
    probing,
)
from executor_service.model.model_support import UnsupportedModel

PROBE_TOKENS = 4


def probe_kv_geometry(
    model: PreTrainedModel, model_type: str, num_layers: int, device: torch.device
) -> LayerGeometry:
    """The one geometry every layer shares; UnsupportedModel when layers keep other state."""
    record: dict[int, ProbedLayer] = {}
    positions = torch.arange(PROBE_TOKENS, device=device)[None, :]
    try:
        with torch.inference_mode(), probing(record):
            model(input_ids=torch.zeros_like(positions), position_ids=positions, use_cache=False)
    except Exception as error:
        raise UnsupportedModel(model_type, f"a forward without cache raised {error!r}") from error
    layers = set(range(num_layers))
    if not record:
        raise UnsupportedModel(
            model_type,
            "none of its layers stores attention K/V through transformers' AttentionInterface "
            "(its layers are recurrent, state-space or convolutional, or its attention bypasses "
            "the interface)",
        )
    if set(record) - layers:
        raise UnsupportedModel(
            model_type, f"attention layer indices {sorted(set(record) - layers)} exceed its {num_layers} layers"
        )
    missing = sorted(layers - set(record))
    if missing:
        raise UnsupportedModel(
            model_type,
            f"{len(missing)} of its {num_layers} layers (first: layer {missing[0]}) keep no "
            "attention K/V (recurrent, state-space, convolution or shared-KV layers), which "
            "the paged KV cache cannot hold",
        )
    if not all(layer.causal for layer in record.values()):
        raise UnsupportedModel(
            model_type, "its attention is bidirectional (an encoder), not causal"
        )
    geometries = sorted(
        {layer.geometry for layer in record.values()},
        key=lambda g: (g.num_kv_heads, g.key_dim, g.value_dim),
    )
    if len(geometries) > 1:
        shown = ", ".join(f"{g.num_kv_heads}x({g.key_dim},{g.value_dim})" for g in geometries)
        raise UnsupportedModel(
            model_type,
            f"its layers store K/V of different shapes (kv_heads x (key, value) widths: {shown}), "
            "which one paged pool cannot hold",
        )
    return geometries[0]
