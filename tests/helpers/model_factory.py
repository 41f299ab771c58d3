"""Small random-weight Hugging Face models for tests, saved as local checkpoints.

    from tests.helpers.model_factory import build_model
    path = build_model("llama", tmp_path / "llama")   # or any name in ARCHITECTURES

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
    AutoConfig,
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

# Windows short enough that prompts of a few hundred tokens run past them.
SHORT_WINDOW = 64
_SLIDING_THEN_GLOBAL = ["sliding_attention", "full_attention"]


def _decoder(model_type: str, **fields: Any) -> Callable[..., PreTrainedConfig]:
    """A tiny config of a registered model type: the shared sizes, then its own fields."""
    return lambda **kw: AutoConfig.for_model(model_type, **{**_DECODER_DEFAULTS, **fields, **kw})


_CONFIGS: dict[str, Callable[..., PreTrainedConfig]] = {
    "llama": lambda **kw: LlamaConfig(**{**_DECODER_DEFAULTS, **kw}),
    "qwen2": lambda **kw: Qwen2Config(**{**_DECODER_DEFAULTS, **kw}),
    "qwen3": lambda **kw: Qwen3Config(**{**_DECODER_DEFAULTS, "head_dim": 16, **kw}),
    "mistral": lambda **kw: MistralConfig(
        **{**_DECODER_DEFAULTS, "sliding_window": SHORT_WINDOW, **kw}
    ),
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
    # Attention logit and final logit soft-capping, sliding and global layers alternating.
    "gemma2": _decoder(
        "gemma2",
        head_dim=16,
        query_pre_attn_scalar=16,
        sliding_window=SHORT_WINDOW,
        layer_types=_SLIDING_THEN_GLOBAL,
        attn_logit_softcapping=5.0,
        final_logit_softcapping=3.0,
    ),
    # Sliding and global layers with their own RoPE bases, query-key norms.
    "gemma3_text": _decoder(
        "gemma3_text",
        head_dim=16,
        query_pre_attn_scalar=16,
        sliding_window=SHORT_WINDOW,
        layer_types=_SLIDING_THEN_GLOBAL,
    ),
    # Decoder layers that do not pass keyword arguments on to attention.
    "stablelm": _decoder("stablelm"),
    "nemotron": _decoder("nemotron", head_dim=16),
    # Attention sinks, alternating sliding layers, mixture of experts.
    "gpt_oss": _decoder(
        "gpt_oss",
        head_dim=16,
        sliding_window=SHORT_WINDOW,
        layer_types=_SLIDING_THEN_GLOBAL,
        num_local_experts=4,
        num_experts_per_tok=2,
    ),
    # Multi-query attention, named by a flag instead of a head count.
    "gpt_bigcode": _decoder("gpt_bigcode", n_embd=64, n_layer=2, n_head=4, n_positions=1024),
    # Multi-head latent attention: keys (nope + rope) wider than values.
    "deepseek_v3": _decoder(
        "deepseek_v3",
        num_key_value_heads=4,
        q_lora_rank=32,
        kv_lora_rank=16,
        qk_nope_head_dim=16,
        qk_rope_head_dim=8,
        v_head_dim=12,
        n_routed_experts=4,
        num_experts_per_tok=2,
        n_group=1,
        topk_group=1,
        moe_intermediate_size=32,
        first_k_dense_replace=1,
    ),
    "qwen3_moe": _decoder(
        "qwen3_moe", head_dim=16, num_experts=4, num_experts_per_tok=2, moe_intermediate_size=32
    ),
    # Fused QKV projection.
    "phi3": _decoder("phi3", pad_token_id=0),
    # Parallel residual, partial rotary.
    "gpt_neox": _decoder("gpt_neox"),
    # Layers without rotary embeddings among those with.
    "smollm3": _decoder("smollm3", pad_token_id=0, no_rope_layers=[1, 0]),
    "olmo2": _decoder("olmo2"),
    "granite": _decoder("granite"),
}

ARCHITECTURES = tuple(_CONFIGS)

# Served, and checked by tests of their own rather than the parity suite: mixtures of experts
# whose routers the executor packs (tests/executor/test_packed_experts.py), and a hybrid of Gated
# DeltaNet and attention layers (three to one) with a dense MLP, the shape the throughput
# benchmark times (tests/e2e/test_hybrid_models.py covers the hybrid families).
_OTHER_CONFIGS: dict[str, Callable[..., PreTrainedConfig]] = {
    "qwen3_next": _decoder(
        "qwen3_next",
        head_dim=16,
        num_experts=0,
        layer_types=["linear_attention", "full_attention"],
        linear_num_key_heads=2,
        linear_num_value_heads=4,
        linear_key_head_dim=16,
        linear_value_head_dim=16,
    ),
    # Top-k of a softmax, always renormalized.
    "mixtral": _decoder("mixtral", head_dim=16, num_local_experts=4, num_experts_per_tok=2),
    # Top-k of a softmax, renormalized as configured; a shared expert behind a sigmoid gate.
    "qwen2_moe": _decoder(
        "qwen2_moe",
        num_experts=4,
        num_experts_per_tok=2,
        moe_intermediate_size=32,
        shared_expert_intermediate_size=48,
        norm_topk_prob=True,
    ),
    "olmoe": _decoder("olmoe", num_experts=4, num_experts_per_tok=2),
}


def build_config(arch: str = "llama", **overrides: Any) -> PreTrainedConfig:
    builders = {**_CONFIGS, **_OTHER_CONFIGS}
    if arch not in builders:
        raise ValueError(f"unknown arch {arch!r}; choose one of {tuple(builders)}")
    return builders[arch](**overrides)


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
