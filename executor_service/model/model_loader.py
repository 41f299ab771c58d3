"""Loads a local Hugging Face decoder-only checkpoint with our paged attention plugged in."""

from __future__ import annotations

import json
import logging
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

import torch
from transformers import (
    AutoConfig,
    AutoModelForCausalLM,
    PretrainedConfig,
    PreTrainedModel,
)
from transformers import __version__ as transformers_version
from transformers.distributed import DistributedConfig
from transformers.models.auto.configuration_auto import CONFIG_MAPPING

from executor_service.attention.paged_attention import (
    ATTENTION_NAME,
    register_paged_attention,
)
from executor_service.model.kv_geometry import (
    PROBE_TOKENS,
    check_layers_kept,
    probe_attention,
    stateless_layers,
)
from executor_service.model.model_support import UnsupportedModel, check_config
from executor_service.model.sequence_rope import install_sequence_rope
from executor_service.recurrent.slot_mixers import (
    RecurrentLayers,
    probe_recurrent_layers,
)
from service_support.local_folder import FolderError, require_folder

if TYPE_CHECKING:
    from executor_service.cpu_forward.lean_forward import LeanLlama

logger = logging.getLogger(__name__)

_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}
# Config attributes that bound a sequence, in the order models use them.
_LENGTH_ATTRIBUTES = ("max_position_embeddings", "n_positions", "max_sequence_length", "seq_length")
MODEL_FOLDER_HOLDS = "config.json and the weights (*.safetensors), as save_pretrained writes them"
# What from_pretrained reads weights from in a local folder, shards included.
_WEIGHT_PATTERNS = ("*.safetensors", "pytorch_model*.bin")


@dataclass(slots=True)
class LoadedModel:
    model: PreTrainedModel
    model_id: str
    model_type: str
    device: torch.device
    dtype: torch.dtype
    vocab_size: int
    eos_token_ids: list[int]
    max_model_len: int
    num_layers: int
    num_heads: int
    # The attention layers' K/V geometry (0s for a model without attention layers).
    num_kv_heads: int
    key_dim: int
    value_dim: int
    # The model's layers that keep K/V in the paged cache, by index.
    attention_layers: tuple[int, ...]
    # Its recurrent, state-space or convolution layers, which keep state slots; None: none.
    recurrent: RecurrentLayers | None = None
    # Set at start-up once fuse_layers has replaced every layer (lean_forward.py): the step's
    # forward runs it instead of the model's own.
    lean: LeanLlama | None = None
    # Rotary frequencies decided per sequence (sequence_rope.py): steps carry token lengths.
    sequence_rope: bool = False


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


def load_model(
    model_dir: Path,
    device: str = "auto",
    dtype: str = "auto",
    max_model_len: int | None = None,
    trust_remote_code: bool = False,
    tensor_parallel_size: int = 1,
) -> LoadedModel:
    """Loads weights from a local folder only; nothing is ever downloaded.

    max_model_len caps the model's own length, and stands in for it when the config names none.
    trust_remote_code runs the modelling code the folder ships (config.json's auto_map).
    tensor_parallel_size > 1 shards the weights over the initialized process group by the
    model's own tensor-parallel plan (every rank calls this together).
    """
    check_model_folder(model_dir, trust_remote_code)
    torch_device = resolve_device(device)
    torch_dtype = resolve_dtype(dtype, torch_device)
    register_paged_attention()
    config = AutoConfig.from_pretrained(
        model_dir, local_files_only=True, trust_remote_code=trust_remote_code
    )
    check_config(config.model_type, config)
    text_config = config.get_text_config()
    if tensor_parallel_size > 1:
        check_tensor_parallel(config.model_type, text_config, tensor_parallel_size)
    model = _instantiate(model_dir, config, torch_dtype, trust_remote_code, tensor_parallel_size)
    if tensor_parallel_size == 1:
        # Sharded weights are placed on the rank's device as they load.
        model.to(torch_device)
    model.eval()
    vocab_size = int(model.get_output_embeddings().weight.shape[0])
    num_layers = _num_layers(config.model_type, text_config)
    attention = probe_attention(model, config.model_type, num_layers, torch_device)
    recurrent = _probe_recurrent(model, config.model_type, set(attention.module_ids), torch_device)
    check_layers_kept(
        config.model_type,
        num_layers,
        attention.layers,
        recurrent.layers if recurrent else (),
        stateless_layers(text_config),
    )
    geometry = attention.geometry
    loaded = LoadedModel(
        model=model,
        model_id=str(model_dir),
        model_type=config.model_type,
        device=torch_device,
        dtype=torch_dtype,
        vocab_size=vocab_size,
        eos_token_ids=_eos_token_ids(model, vocab_size),
        max_model_len=_max_model_len(config.model_type, text_config, max_model_len),
        num_layers=num_layers,
        # A state-space model (Mamba) has no attention heads.
        num_heads=int(getattr(text_config, "num_attention_heads", 0) or 0),
        num_kv_heads=geometry.num_kv_heads if geometry else 0,
        key_dim=geometry.key_dim if geometry else 0,
        value_dim=geometry.value_dim if geometry else 0,
        attention_layers=attention.layers,
        recurrent=recurrent,
        sequence_rope=install_sequence_rope(model),
    )
    logger.info(
        "event=model_loaded model=%s model_type=%s arch=%s device=%s dtype=%s vocab_size=%d "
        "layers=%d attention_layers=%d recurrent_layers=%d kv_heads=%d key_dim=%d value_dim=%d "
        "max_model_len=%d eos=%s",
        loaded.model_id,
        loaded.model_type,
        type(model).__name__,
        torch_device,
        dtype_name(torch_dtype),
        vocab_size,
        loaded.num_layers,
        len(loaded.attention_layers),
        len(recurrent.layers) if recurrent else 0,
        loaded.num_kv_heads,
        loaded.key_dim,
        loaded.value_dim,
        loaded.max_model_len,
        loaded.eos_token_ids,
    )
    return loaded


def _num_layers(model_type: str, text_config: PretrainedConfig) -> int:
    layers = getattr(text_config, "num_hidden_layers", None)
    if not isinstance(layers, int) or layers < 1:
        raise UnsupportedModel(
            model_type, "its text config names no layer count (num_hidden_layers): its layers sit in sub-models of their own"
        )
    return layers


def _probe_recurrent(
    model: PreTrainedModel, model_type: str, attention_modules: set[int], device: torch.device
) -> RecurrentLayers | None:
    try:
        return probe_recurrent_layers(model, attention_modules, device, PROBE_TOKENS)
    except Exception as error:
        raise UnsupportedModel(
            model_type, f"a forward of its recurrent layers against state slots raised {error!r}"
        ) from error


def check_model_folder(model_dir: Path, trust_remote_code: bool = False) -> None:
    """Refuses, before anything is loaded, a folder that is no checkpoint transformers can load:
    FolderError says what is missing, UnsupportedModel names a model type transformers lacks."""
    require_folder(model_dir, MODEL_FOLDER_HOLDS)
    config_path = model_dir / "config.json"
    if not config_path.is_file():
        raise FolderError(f"{model_dir}: holds no config.json; a model folder holds {MODEL_FOLDER_HOLDS}")
    try:
        config = json.loads(config_path.read_text())
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as error:
        raise FolderError(
            f"{config_path}: not readable as JSON ({error}); a model folder holds {MODEL_FOLDER_HOLDS}"
        ) from error
    model_type = config.get("model_type") if isinstance(config, dict) else None
    if not isinstance(model_type, str) or not model_type:
        raise FolderError(f"{config_path}: names no model_type; a model folder holds {MODEL_FOLDER_HOLDS}")
    if not any(any(model_dir.glob(pattern)) for pattern in _WEIGHT_PATTERNS):
        gguf = " (GGUF files are not loaded)" if any(model_dir.glob("*.gguf")) else ""
        raise FolderError(
            f"{model_dir}: holds config.json but no weights{gguf}; a model folder holds {MODEL_FOLDER_HOLDS}"
        )
    _check_model_type_known(model_type, "auto_map" in config, trust_remote_code)


def _check_model_type_known(model_type: str, ships_code: bool, trust_remote_code: bool) -> None:
    """A one-line refusal where transformers would raise its own (a multi-line ValueError) from
    deep inside AutoConfig."""
    if model_type in CONFIG_MAPPING or (ships_code and trust_remote_code):
        return
    if ships_code:
        raise UnsupportedModel(
            model_type, "its modelling code ships in the folder (auto_map); pass --trust-remote-code to run it"
        )
    raise UnsupportedModel(
        model_type,
        f"transformers {transformers_version} does not know it; upgrade transformers, or use a "
        "folder that ships its modelling code (auto_map) with --trust-remote-code",
    )


def check_tensor_parallel(model_type: str, text_config: PretrainedConfig, size: int) -> None:
    """Refuses tensor parallelism the model has no plan for, or whose heads do not split evenly."""
    if not getattr(text_config, "base_model_tp_plan", None):
        raise UnsupportedModel(
            model_type, "it has no tensor-parallel plan in transformers; run it with --tensor-parallel-size 1"
        )
    heads = int(text_config.num_attention_heads)
    kv_heads = int(getattr(text_config, "num_key_value_heads", None) or heads)
    if heads % size or kv_heads % size:
        raise UnsupportedModel(
            model_type,
            f"its {heads} attention heads and {kv_heads} K/V heads do not split evenly over "
            f"--tensor-parallel-size {size}",
        )


def _instantiate(
    model_dir: Path,
    config: PretrainedConfig,
    dtype: torch.dtype,
    trust_remote_code: bool,
    tensor_parallel_size: int,
) -> PreTrainedModel:
    """The model with our attention, or UnsupportedModel when it cannot take it."""
    sharding = (
        {"distributed_config": DistributedConfig(tp_size=tensor_parallel_size)}
        if tensor_parallel_size > 1
        else {}
    )
    try:
        return AutoModelForCausalLM.from_pretrained(
            model_dir,
            config=config,
            dtype=dtype,
            attn_implementation=ATTENTION_NAME,
            local_files_only=True,
            trust_remote_code=trust_remote_code,
            **sharding,
        )
    except KeyError as error:
        # Models that pick an attention class from a table keyed by implementation name have
        # no entry for ours: their attention never goes through AttentionInterface.
        if ATTENTION_NAME not in str(error):
            raise
        raise UnsupportedModel(
            config.model_type,
            "it picks its attention class by name instead of through transformers' "
            "AttentionInterface, so paged attention cannot be plugged in",
        ) from error
    except ValueError as error:
        # transformers refuses a custom attention for models that declare they cannot use one.
        if ATTENTION_NAME not in str(error):
            raise
        raise UnsupportedModel(config.model_type, f"transformers refuses custom attention: {error}") from error


def _eos_token_ids(model: PreTrainedModel, vocab_size: int) -> list[int]:
    """EOS ids of the generation config (which falls back to the model config), in vocab only."""
    ids: list[int] = []
    text_config = model.config.get_text_config()
    for source in (model.generation_config.eos_token_id, getattr(text_config, "eos_token_id", None)):
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


def _max_model_len(model_type: str, text_config: object, cap: int | None) -> int:
    own = next(
        (
            value
            for name in _LENGTH_ATTRIBUTES
            if isinstance(value := getattr(text_config, name, None), int) and value > 0
        ),
        None,
    )
    if own is None and cap is None:
        raise UnsupportedModel(
            model_type, "its config names no maximum sequence length; pass --max-model-len"
        )
    if own is not None:
        own = int(own * _dynamic_rope_factor(text_config))
    return min(length for length in (own, cap) if length is not None)


def _dynamic_rope_factor(text_config: object) -> float:
    """How far dynamic NTK scaling stretches the model's positions past max_position_embeddings
    (its `factor`, as vLLM reads it; the smallest where layer types differ), or 1. Such a model
    exists to be run past its trained length: its rotary frequencies only change there
    (sequence_rope.py decides them per sequence)."""
    parameters = getattr(text_config, "rope_parameters", None)
    if not isinstance(parameters, dict):
        return 1.0
    # One dict of parameters, or one per layer type (full_attention, sliding_attention, ...).
    kinds = [parameters] if "rope_type" in parameters else [v for v in parameters.values() if isinstance(v, dict)]
    factors = [float(kind.get("factor", 1.0)) for kind in kinds if kind.get("rope_type") == "dynamic"]
    return max(1.0, min(factors)) if factors and len(factors) == len(kinds) else 1.0
