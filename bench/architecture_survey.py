"""Which of transformers' causal-LM architectures the executor serves, and why it refuses the
others: for every registered model type, a tiny random-weight model is built from the type's own
default config shrunk to test sizes (its nested configs too: a multimodal model's text and vision
configs), saved as the checkpoint people download (a type whose causal-LM class takes only its
text config as its ...ForConditionalGeneration model), and the executor starts on it as it would
in production (load, K/V geometry probe, start-up self-check against the model's own eager
forward).

    python -m bench.architecture_survey [--types llama,gemma2] [--timeout 120] [--out FILE]

Each type runs in a process of its own (a model may exhaust memory or hang). Results are one JSON
line per type: "served", "refused" (the executor's own reason) or "unbuilt" (no tiny model could
be made from the shrunk default config: a limit of this survey, not a verdict on the model).
"""

from __future__ import annotations

import argparse
import json
import logging
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

logger = logging.getLogger("bench.architecture_survey")

# Test sizes, applied to whichever of these names a type's config has.
_SMALL: dict[str, Any] = {
    "vocab_size": 1024,
    "hidden_size": 64,
    "intermediate_size": 128,
    "num_hidden_layers": 2,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "head_dim": 16,
    "max_position_embeddings": 1024,
    "n_embd": 64,
    "n_layer": 2,
    "n_head": 4,
    "n_positions": 1024,
    "n_inner": 128,
    "d_model": 64,
    "ffn_dim": 128,
    "moe_intermediate_size": 32,
    "num_experts": 4,
    "n_routed_experts": 4,
    "num_local_experts": 4,
    "num_experts_per_tok": 2,
    "shared_expert_intermediate_size": 32,
    "n_ctx": 1024,
    "num_layers": 2,
    "num_heads": 4,
    "decoder_layers": 2,
    "decoder_attention_heads": 4,
    "decoder_ffn_dim": 128,
    "bos_token_id": 1,
    "eos_token_id": 2,
    "pad_token_id": 0,
    "tie_word_embeddings": False,
    # A multimodal checkpoint's vision tower: built, never run (requests are text).
    "image_size": 32,
    "patch_size": 8,
}
SHORT_WINDOW = 64


def tiny_config(config_class: Any) -> Any:
    """The type's default config shrunk to test sizes, its nested configs (a multimodal model's
    text and vision configs, ...) too, each built by its own class from its shrunk fields."""
    default = config_class()
    fields = _small_fields(default)
    for name in getattr(default, "sub_configs", {}):
        sub = getattr(default, name, None)
        if sub is not None and hasattr(sub, "to_dict"):
            fields[name] = {**sub.to_dict(), **_small_fields(sub, nested=True)}
    return config_class(**fields)


def _small_fields(config: Any, nested: bool = False) -> dict[str, Any]:
    fields = {k: v for k, v in _SMALL.items() if _has(config, k)}
    if all(_has(config, k) for k in ("expand", "num_heads", "head_dim", "hidden_size")):
        # Mamba-2 mixers split hidden_size * expand into num_heads heads of head_dim.
        fields["num_heads"] = fields["hidden_size"] * config.expand // fields["head_dim"]
    if _has(config, "sliding_window") and config.sliding_window:
        fields["sliding_window"] = SHORT_WINDOW
    fields.update(_consistent_fields(config, fields))
    # A nested config is rebuilt from all its fields, so its per-layer lists (attention kinds)
    # are cut to the layers kept, keeping the type's pattern; a top-level class derives its own.
    layers = fields.get("num_hidden_layers")
    if nested and layers is not None:
        whole = config.to_dict()
        # Layers that differ from the rest (gemma4's global ones) are kept: as many layers as
        # reach the first of them.
        overrides = whole.get("per_layer_config")
        if isinstance(overrides, dict) and overrides:
            layers = fields["num_hidden_layers"] = max(layers, min(int(k) for k in overrides) + 1)
        for name, value in whole.items():
            if name.endswith("layer_types") and isinstance(value, list):
                fields[name] = value[:layers]
            elif name == "per_layer_config" and isinstance(value, dict):
                fields[name] = {k: v for k, v in value.items() if int(k) < layers}
    return fields


def _consistent_fields(config: Any, fields: dict[str, Any]) -> dict[str, Any]:
    """Sizes that must agree with the shrunk ones: the default's values, kept, would not fit the
    small heads, layers or experts."""
    out: dict[str, Any] = {}

    def value(name: str) -> Any:
        return fields[name] if name in fields else (getattr(config, name, None) if _has(config, name) else None)

    # Multi-head latent attention: compressed ranks and per-head widths, the rotary part of a
    # query/key head among them (head_dim, where the config holds it, is that rotary width);
    # keys and values are expanded per query head, so there are as many K/V heads as query heads.
    if value("qk_rope_head_dim") is not None:
        rope = 8
        out.update(qk_rope_head_dim=rope, qk_nope_head_dim=16, kv_lora_rank=32)
        if _has(config, "num_key_value_heads"):
            out["num_key_value_heads"] = value("num_attention_heads")
        if _has(config, "v_head_dim"):
            out["v_head_dim"] = 16
        if value("q_lora_rank") is not None:
            out["q_lora_rank"] = 48
        if _has(config, "qk_head_dim"):
            out["qk_head_dim"] = rope + 16
        if _has(config, "head_dim") and config.head_dim == config.qk_rope_head_dim:
            out["head_dim"] = rope
    # A rotary width of its own (GPT-J, CodeGen) within the shrunk head.
    if value("rotary_dim") is not None:
        out["rotary_dim"] = 8
    # Grouped expert routing: groups that divide the experts, top-k groups among them.
    experts = value("n_routed_experts") or value("num_experts") or value("num_local_experts")
    if experts and (value("n_group") or 1) > 1:
        out["n_group"] = 2
        if value("topk_group") is not None:
            out["topk_group"] = 1
    # Leading dense layers: one, so the other layer is a mixture of experts.
    if (value("first_k_dense_replace") or 0) > 1:
        out["first_k_dense_replace"] = 1
    return out


def _has(config: Any, name: str) -> bool:
    """Whether the config sets this field; a field some configs hold per layer (and refuse to
    read whole) counts as unset."""
    try:
        return hasattr(config, name)
    except Exception:
        return False


def published_class(config: Any) -> Any:
    """What a checkpoint of this type is saved as: its causal-LM class, or, where that class
    takes only the text half of the config (mllama, emu3), the image-text-to-text model whose
    folder people download (the executor serves that folder's text model)."""
    from transformers import AutoModelForCausalLM, AutoModelForImageTextToText
    from transformers.models.auto.modeling_auto import (
        MODEL_FOR_CAUSAL_LM_MAPPING,
        MODEL_FOR_IMAGE_TEXT_TO_TEXT_MAPPING,
    )

    causal = MODEL_FOR_CAUSAL_LM_MAPPING.get(type(config), None)
    if causal is not None and not isinstance(config, causal.config_class) and type(config) in MODEL_FOR_IMAGE_TEXT_TO_TEXT_MAPPING:
        return AutoModelForImageTextToText
    return AutoModelForCausalLM


def survey_one(model_type: str, folder: Path) -> dict[str, Any]:
    """Builds the tiny model and starts the executor on it, in this process."""
    import torch
    from transformers.models.auto.configuration_auto import CONFIG_MAPPING

    from executor_service.model.model_support import UnsupportedModel
    from executor_service.serving.settings import ExecutorSettings
    from executor_service.startup.startup import build_executor

    torch.set_num_threads(1)
    try:
        config = tiny_config(CONFIG_MAPPING[model_type])
        torch.manual_seed(0)
        model_class = published_class(config)
        model = model_class.from_config(config, dtype=torch.float32, attn_implementation="eager")
        with torch.no_grad():
            for parameter in model.parameters():
                if parameter.dim() >= 2:
                    parameter.normal_(0.0, 0.2)
            # The shrunk config must run in the model's own code before ours is judged on it;
            # a multimodal model's text path is judged by the executor's self-check alone (some
            # of their forwards fail on text without images in transformers' own code).
            if model_class.__name__ == "AutoModelForCausalLM":
                model(input_ids=torch.arange(3, 11)[None, :], use_cache=False)
        model.save_pretrained(folder)
    except Exception as error:
        return {"status": "unbuilt", "reason": f"{type(error).__name__}: {error}"[:300]}
    try:
        # max_model_len stands in where a config names none (Mamba's): a flag, not a refusal.
        settings = ExecutorSettings(model_dir=folder, device="cpu", dtype="float32", num_kv_blocks=256, max_model_len=1024)
        build_executor(settings)
    except UnsupportedModel as refusal:
        return {"status": "refused", "reason": refusal.reason}
    except Exception as error:
        return {"status": "error", "reason": f"{type(error).__name__}: {error}"[:300]}
    return {"status": "served"}


def causal_lm_types() -> list[str]:
    from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING_NAMES

    return sorted(MODEL_FOR_CAUSAL_LM_MAPPING_NAMES)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m bench.architecture_survey")
    parser.add_argument("--types", default="", help="comma-separated model types (default: all)")
    parser.add_argument("--timeout", type=float, default=120.0, help="seconds per type")
    parser.add_argument("--out", type=Path, default=None, help="JSON lines file")
    parser.add_argument("--one", default=None, help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(message)s")
    if args.one is not None:
        with tempfile.TemporaryDirectory() as folder:
            print(json.dumps(survey_one(args.one, Path(folder))))
        return 0
    types = [t for t in args.types.split(",") if t] or causal_lm_types()
    out = args.out.open("w") if args.out is not None else None
    counts: dict[str, int] = {}
    for model_type in types:
        started = time.monotonic()
        try:
            run = subprocess.run(
                [sys.executable, "-m", "bench.architecture_survey", "--one", model_type],
                capture_output=True,
                text=True,
                timeout=args.timeout,
            )
            lines = run.stdout.strip().splitlines()
            result = json.loads(lines[-1]) if run.returncode == 0 and lines else {
                "status": "error",
                "reason": f"exit {run.returncode}: {run.stderr.strip().splitlines()[-1:]}",
            }
        except subprocess.TimeoutExpired:
            result = {"status": "error", "reason": f"no result within {args.timeout:.0f} s"}
        result = {"model_type": model_type, **result, "seconds": round(time.monotonic() - started, 1)}
        counts[result["status"]] = counts.get(result["status"], 0) + 1
        logger.info("%s %s %s", model_type, result["status"], result.get("reason", ""))
        if out is not None:
            out.write(json.dumps(result) + "\n")
            out.flush()
    logger.info("summary %s", " ".join(f"{k}={v}" for k, v in sorted(counts.items())))
    return 0


if __name__ == "__main__":
    sys.exit(main())
