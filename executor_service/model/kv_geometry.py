"""What a model's layers keep per sequence, measured by tiny forwards rather than read from
configs.

Configs describe heads and widths in many ways (multi-query flags, latent-attention ranks, head
widths that differ for keys and values); the tensors attention is handed do not. One forward of a
few tokens, run without a cache, records per layer the K/V heads and widths our attention
receives, and the paged cache is shaped from that. Layers without attention must be recurrent
(recurrent/slot_mixers.py probes those): every layer keeps one or the other, or both.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from transformers import PreTrainedModel

from executor_service.attention.paged_attention import (
    LayerGeometry,
    ProbedLayer,
    probing,
)
from executor_service.model.model_support import UnsupportedModel

PROBE_TOKENS = 4


@dataclass(slots=True, frozen=True)
class AttentionLayers:
    """The attention layers a probe saw: their shared K/V geometry (None: the model has no
    attention layer), their indices, and the attention modules themselves (by id())."""

    geometry: LayerGeometry | None
    layers: tuple[int, ...]
    module_ids: frozenset[int]


def probe_attention(
    model: PreTrainedModel, model_type: str, num_layers: int, device: torch.device
) -> AttentionLayers:
    """The attention layers and the one geometry they share; UnsupportedModel when they differ
    or are not causal self-attention."""
    record: dict[int, ProbedLayer] = {}
    positions = torch.arange(PROBE_TOKENS, device=device)[None, :]
    try:
        with torch.inference_mode(), probing(record):
            model(input_ids=torch.zeros_like(positions), position_ids=positions, use_cache=False)
    except Exception as error:
        raise UnsupportedModel(model_type, f"a forward without cache raised {error!r}") from error
    layers = set(range(num_layers))
    if set(record) - layers:
        raise UnsupportedModel(
            model_type, f"attention layer indices {sorted(set(record) - layers)} exceed its {num_layers} layers"
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
    return AttentionLayers(
        geometry=geometries[0] if geometries else None,
        layers=tuple(sorted(record)),
        module_ids=frozenset(layer.module_id for layer in record.values()),
    )


# Layer types of layers with no token mixer at all (Nemotron-H's MLP and MoE layers): they keep
# nothing per sequence, as transformers' own caches agree (a DummyLayer for each).
STATELESS_LAYER_TYPES = ("mlp", "moe")


def stateless_layers(text_config: object) -> tuple[int, ...]:
    layer_types = getattr(text_config, "layer_types", None) or []
    return tuple(i for i, kind in enumerate(layer_types) if kind in STATELESS_LAYER_TYPES)


def check_layers_kept(
    model_type: str,
    num_layers: int,
    attention: tuple[int, ...],
    recurrent: tuple[int, ...],
    stateless: tuple[int, ...] = (),
) -> None:
    """Refuses a model with a layer that keeps neither attention K/V nor recurrent state that
    the executor can hold (shared-KV layers, or a mixer outside transformers' cache interface),
    unless its config says it mixes no tokens (stateless)."""
    if not attention and not recurrent:
        raise UnsupportedModel(
            model_type,
            "none of its layers stores attention K/V through transformers' AttentionInterface "
            "or recurrent state through its cache interface",
        )
    missing = sorted(set(range(num_layers)) - set(attention) - set(recurrent) - set(stateless))
    if missing:
        raise UnsupportedModel(
            model_type,
            f"{len(missing)} of its {num_layers} layers (first: layer {missing[0]}) keep neither "
            "attention K/V nor recurrent state through transformers' cache interface (shared-KV "
            "layers, or a mixer of its own), which the executor cannot hold",
        )
