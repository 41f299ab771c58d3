"""Tiny random models of the hybrid and state-space families, each with both kinds of layer its
family has (attention beside Mamba, Gated DeltaNet, short convolution or lightning-attention
layers), recurrent widths small enough for a test and chunk sizes small enough that a 300-token
prompt crosses several of the scan's chunks."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch
from transformers import AutoModelForCausalLM
from transformers.models.auto.configuration_auto import CONFIG_MAPPING

from bench.architecture_survey import tiny_config

_LIN, _FULL = "linear_attention", "full_attention"
_GATED_DELTA = {
    "num_hidden_layers": 4,
    "layer_types": [_LIN, _LIN, _LIN, _FULL],
    "linear_key_head_dim": 16,
    "linear_value_head_dim": 16,
    "linear_num_key_heads": 2,
    "linear_num_value_heads": 4,
}
HYBRID_FIELDS: dict[str, dict[str, Any]] = {
    "jamba": {"num_hidden_layers": 4, "attn_layer_period": 2, "attn_layer_offset": 1, "expert_layer_period": 2, "expert_layer_offset": 1},
    "bamba": {
        "num_hidden_layers": 4,
        "attn_layer_indices": [1, 3],
        "mamba_n_heads": 8,
        "mamba_d_head": 16,
        "mamba_d_state": 16,
        "mamba_chunk_size": 32,
    },
    "granitemoehybrid": {
        "num_hidden_layers": 4,
        "layer_types": ["mamba", "attention", "mamba", "attention"],
        "mamba_n_heads": 8,
        "mamba_d_head": 16,
        "mamba_d_state": 16,
        "mamba_chunk_size": 32,
    },
    "lfm2": {"num_hidden_layers": 4, "full_attn_idxs": [1, 3], "layer_types": ["conv", _FULL, "conv", _FULL]},
    "mamba": {"num_hidden_layers": 3},
    "mamba2": {"num_hidden_layers": 3, "state_size": 16, "n_groups": 2, "chunk_size": 32},
    "qwen3_next": _GATED_DELTA,
    "qwen3_5_text": _GATED_DELTA,
    "nemotron_h": {
        "layers_block_type": [_LIN, "mlp", _FULL, _LIN],
        "mamba_num_heads": 8,
        "mamba_head_dim": 16,
        "ssm_state_size": 16,
        "n_groups": 2,
        "chunk_size": 32,
    },
    "falcon_h1": {
        "num_hidden_layers": 3,
        "mamba_n_heads": 8,
        "mamba_d_head": 16,
        "mamba_d_ssm": 128,
        "mamba_d_state": 16,
        "mamba_chunk_size": 32,
    },
    "minimax": {"num_hidden_layers": 4, "layer_types": [_LIN, _FULL, _LIN, _FULL]},
    "olmo_hybrid": {"num_hidden_layers": 4, "layer_types": [_LIN, _FULL, _LIN, _FULL]},
}
HYBRID_TYPES = tuple(HYBRID_FIELDS)


def hybrid_config(model_type: str, **overrides: Any) -> Any:
    config_class = CONFIG_MAPPING[model_type]
    fields = {**tiny_config(config_class).to_dict(), **HYBRID_FIELDS[model_type], **overrides}
    fields.pop("model_type", None)
    return config_class(**fields)


def save_hybrid(model_type: str, folder: Path, **overrides: Any) -> Path:
    """A random model of the type saved to folder (weights drawn wide enough that greedy picks
    are not near-ties)."""
    config = hybrid_config(model_type, **overrides)
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    with torch.no_grad():
        for parameter in model.parameters():
            if parameter.dim() >= 2:
                parameter.normal_(0.0, 0.2)
    model.save_pretrained(folder)
    return folder
