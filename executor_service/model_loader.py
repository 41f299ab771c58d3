"""Loads a local Hugging Face decoder-only checkpoint with our paged attention plugged in."""

from __future__ import annotations

import logging
from dataclasses import dataclass
from pathlib import Path

import torch
from transformers import AutoConfig, AutoModelForCausalLM, PreTrainedModel

from executor_service.paged_attention import ATTENTION_NAME, register_paged_attention

logger = logging.getLogger(__name__)

_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}
# Config attributes that bound a sequence, in the order models use them.
_LENGTH_ATTRIBUTES = ("max_position_embeddings", "n_positions", "max_sequence_length", "seq_length")


@dataclass(slots=True)
class LoadedModel:
    model: PreTrainedModel
    model_id: str
    device: torch.device
    dtype: torch.dtype
    vocab_size: int
    eos_token_ids: list[int]
    max_model_len: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int


def resolve_device(name: str) -> torch.device:
    if name == "auto":
        return torch.device("cuda:0" if torch.cuda.is_available() else "cpu")
    device = torch.device(name)
    if device.type == "cuda" and device.index is None:
        device = torch.device("cuda:0")
    return device


def resolve_dtype(name: str, device: torch.device) -> torch.dtype:
    if name != "auto":
        return _DTYPES[name]
    if device.type == "cuda":
        return torch.bfloat16 if torch.cuda.is_bf16_supported() else torch.float16
    # CPU bf16 matmuls are slow on most hosts and fp32 keeps parity with reference runs.
    return torch.float32


def dtype_name(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")


def load_model(model_dir: Path, device: str = "auto", dtype: str = "auto") -> LoadedModel:
    """Loads weights from a local folder only; nothing is ever downloaded."""
    if not (model_dir / "config.json").is_file():
        raise FileNotFoundError(f"{model_dir} holds no config.json")
    torch_device = resolve_device(device)
    torch_dtype = resolve_dtype(dtype, torch_device)
    register_paged_attention()
    config = AutoConfig.from_pretrained(model_dir, local_files_only=True)
    model = AutoModelForCausalLM.from_pretrained(
        model_dir,
        config=config,
        dtype=torch_dtype,
        attn_implementation=ATTENTION_NAME,
        local_files_only=True,
    )
    model.to(torch_device)
    model.eval()
    text_config = config.get_text_config()
    vocab_size = int(model.get_output_embeddings().weight.shape[0])
    num_heads = int(text_config.num_attention_heads)
    head_dim = getattr(text_config, "head_dim", None) or text_config.hidden_size // num_heads
    loaded = LoadedModel(
        model=model,
        model_id=str(model_dir),
        device=torch_device,
        dtype=torch_dtype,
        vocab_size=vocab_size,
        eos_token_ids=_eos_token_ids(model, vocab_size),
        max_model_len=_max_model_len(text_config),
        num_layers=int(text_config.num_hidden_layers),
        num_heads=num_heads,
        num_kv_heads=int(getattr(text_config, "num_key_value_heads", None) or num_heads),
        head_dim=int(head_dim),
    )
    logger.info(
        "event=model_loaded model=%s arch=%s device=%s dtype=%s vocab_size=%d layers=%d "
        "kv_heads=%d head_dim=%d max_model_len=%d eos=%s",
        loaded.model_id,
        type(model).__name__,
        torch_device,
        dtype_name(torch_dtype),
        vocab_size,
        loaded.num_layers,
        loaded.num_kv_heads,
        loaded.head_dim,
        loaded.max_model_len,
        loaded.eos_token_ids,
    )
    return loaded


def _eos_token_ids(model: PreTrainedModel, vocab_size: int) -> list[int]:
    """EOS ids of the generation config (which falls back to the model config), in vocab only."""
    ids: list[int] = []
    text_config = model.config.get_text_config()
    for source in (model.generation_config.eos_token_id, text_config.eos_token_id):
        if source is None:
            continue
        for token in [source] if isinstance(source, int) else source:
            if token not in ids:
                ids.append(int(token))
        # The generation config, when it names EOS ids, is what generate() stops on.
        if ids:
            break
    outside = [token for token in ids if not 0 <= token < vocab_size]
    if outside:
        logger.warning("event=eos_outside_vocab eos=%s vocab_size=%d", outside, vocab_size)
    return [token for token in ids if 0 <= token < vocab_size]


def _max_model_len(text_config: object) -> int:
    for name in _LENGTH_ATTRIBUTES:
        value = getattr(text_config, name, None)
        if isinstance(value, int) and value > 0:
            return value
    raise ValueError("the model config names no maximum sequence length")
