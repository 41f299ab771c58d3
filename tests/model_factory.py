"""Small random-weight Hugging Face models for tests, saved as local checkpoints.

    from tests.model_factory import build_model
    path = build_model("llama", tmp_path / "llama")   # or "qwen2", "qwen3", "mistral", "gpt2"

(run from the repository root, as `python -m pytest` does, so `tests.` imports resolve.)

Weights are drawn with std 0.2 (instead of the usual 0.02) so greedy decoding is decided by clear
margins rather than near-ties, which keeps parity tests stable across kernels and batch shapes.
"""

from __future__ import annotations

import tempfile
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
from transformers import (
    AutoModelForCausalLM,
    GenerationConfig,
    GPT2Config,
    LlamaConfig,
    MistralConfig,
    PreTrainedConfig,
    Qwen2Config,
    Qwen3Config,
)

VOCAB_SIZE = 1024
BOS_TOKEN_ID = 1
EOS_TOKEN_ID = 2
INIT_STD = 0.2

_DECODER_DEFAULTS: dict[str, Any] = {
    "vocab_size": VOCAB_SIZE,
    "hidden_size": 64,
    "intermediate_size": 128,
    "num_hidden_layers": 2,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "max_position_embeddings": 1024,
    "bos_token_id": BOS_TOKEN_ID,
    "eos_token_id": EOS_TOKEN_ID,
    "tie_word_embeddings": False,
    "initializer_range": INIT_STD,
}

_CONFIGS: dict[str, Callable[..., PreTrainedConfig]] = {
    "llama": lambda **kw: LlamaConfig(**{**_DECODER_DEFAULTS, **kw}),
    "qwen2": lambda **kw: Qwen2Config(**{**_DECODER_DEFAULTS, **kw}),
    "qwen3": lambda **kw: Qwen3Config(**{**_DECODER_DEFAULTS, "head_dim": 16, **kw}),
    # A short window, so prompts of a few hundred tokens exercise sliding-window attention.
    "mistral": lambda **kw: MistralConfig(**{**_DECODER_DEFAULTS, "sliding_window": 64, **kw}),
    "gpt2": lambda **kw: GPT2Config(
        **{
            "vocab_size": VOCAB_SIZE,
            "n_embd": 64,
            "n_layer": 2,
            "n_head": 4,
            "n_positions": 1024,
            "bos_token_id": BOS_TOKEN_ID,
            "eos_token_id": EOS_TOKEN_ID,
            "initializer_range": INIT_STD,
            **kw,
        }
    ),
}

ARCHITECTURES = tuple(_CONFIGS)


def build_config(arch: str = "llama", **overrides: Any) -> PreTrainedConfig:
    if arch not in _CONFIGS:
        raise ValueError(f"unknown arch {arch!r}; choose one of {ARCHITECTURES}")
    return _CONFIGS[arch](**overrides)


def build_model(
    arch: str = "llama", directory: Path | str | None = None, seed: int = 0, **overrides: Any
) -> Path:
    """Saves a random-weight model (config, safetensors, generation config) into directory (a new
    temporary folder when None) and returns it. The same arch, seed and overrides give the same
    weights.

    overrides replace config fields, e.g. num_hidden_layers=4 or vocab_size=2000.
    """
    directory = Path(directory) if directory is not None else Path(tempfile.mkdtemp(prefix=arch))
    config = build_config(arch, **overrides)
    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    # Norm weights start at one and biases at zero; widen the rest beyond the default init.
    with torch.no_grad():
        for parameter in model.parameters():
            if parameter.dim() >= 2:
                parameter.normal_(0.0, INIT_STD)
    model.generation_config = GenerationConfig(
        bos_token_id=config.bos_token_id,
        eos_token_id=config.eos_token_id,
        pad_token_id=config.eos_token_id,
    )
    directory.mkdir(parents=True, exist_ok=True)
    model.save_pretrained(directory, safe_serialization=True)
    return directory
