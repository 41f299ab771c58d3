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
import copy
import json
import logging
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from types import SimpleNamespace
from typing import Any

logger = logging.getLogger("bench.architecture_survey")

# Test sizes, applied to whichever of these names a type's config has.
_SMALL: dict[str, Any] = {
    "vocab_size": 1024,
    # blt's hashed byte n-gram embeddings, one table of this many rows per n.
    "encoder_hash_byte_group_vocab": 1024,
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
    # ProphetNet's, whose num_hidden_layers it refuses to set.
    "num_encoder_layers": 2,
    "num_decoder_layers": 2,
    "num_encoder_attention_heads": 4,
    "num_decoder_attention_heads": 4,
    "bos_token_id": 1,
    "eos_token_id": 2,
    "pad_token_id": 0,
    "tie_word_embeddings": False,
    # A multimodal checkpoint's vision tower: built, never run (requests are text).
    "image_size": 32,
    "patch_size": 8,
}
SHORT_WINDOW = 64
# The names a config gives its layer count.
_LAYER_COUNTS = ("num_hidden_layers", "num_layers", "n_layer", "n_layers", "decoder_layers")

# What a type's own default config lacks or gets wrong, at any size, and its released checkpoints
# carry: taken into the default before it is shrunk (a callable is given the default first).
_TYPE_FIELDS: dict[str, Any] = {
    # DbrxAttention reads attn_config.rope_theta, which DbrxAttentionConfig does not declare, and
    # clamps its projections to clip_qkv, which defaults to None (torch refuses a clamp to None).
    "dbrx": {"attn_config": {"rope_theta": 10000.0, "clip_qkv": 8.0}},
    # The rotary embedding reads rope_parameters[layer_type], which defaults to {}; its M-RoPE
    # sections (the code's default, [24, 20, 20], is for 128-wide heads) sum to half the small
    # head width.
    "cohere_compass_text": {
        "rope_parameters": {
            "full_attention": {"rope_type": "default", "rope_theta": 10000.0, "mrope_section": [4, 2, 2]}
        }
    },
    # Its shared-expert MLP is moe_intermediate_size * n_shared_experts wide; n_shared_experts
    # defaults to None.
    "dots1": {"n_shared_experts": 1},
    # Its layers read layer_types, which defaults to None: short convolutions with an attention
    # layer every fourth, LFM2's kind of mix.
    "lfm2_moe": lambda config: {
        "layer_types": ["full_attention" if i % 4 == 2 else "conv" for i in range(config.num_hidden_layers)]
    },
    # Its image-token mapping reads vocabulary_map, which defaults to None: a few entries of the
    # tokenizer's (no image is ever given).
    "emu3": {"vocabulary_map": {"<image>": 1000, "<|extra_200|>": 1001, "<|visual token 000000|>": 1002}},
    # The default text config fails the assistant's own validator: a drafter has no per-layer
    # input embeddings.
    "gemma4_assistant": {"text_config": {"hidden_size_per_layer_input": 0, "vocab_size_per_layer_input": 0}},
    # ReformerModelWithLMHead refuses a config that is not a decoder's.
    "reformer": {"is_decoder": True},
}
# Drafters for speculative decoding, whose forward takes the input embeddings and K/V of the model
# they draft for (shared_kv_states), never token ids alone: built and saved, not run here.
_DRAFTERS = {"gemma4_assistant", "gemma4_unified_assistant"}


def tiny_config(config_class: Any) -> Any:
    """The type's default config shrunk to test sizes, its nested configs (a multimodal model's
    text and vision configs, ...) too, each built by its own class from its shrunk fields."""
    fixes = _TYPE_FIELDS.get(config_class.model_type, {})
    default = config_class(**({} if callable(fixes) else fixes))
    if callable(fixes):
        fixes = fixes(default)
        default = config_class(**fixes)
    fields = {**fixes, **_small_fields(default)}
    subs = {name: getattr(default, name, None) for name in getattr(default, "sub_configs", {})}
    subs = {name: sub for name, sub in subs.items() if sub is not None and hasattr(sub, "to_dict")}
    # Widths that join towers (dots3_note's vision and audio adapters, blt's hidden_size_global)
    # are as wide as the hidden sizes they join, all of which shrink alike.
    hidden = {getattr(c, "hidden_size", None) for c in (default, *subs.values()) if _has(c, "hidden_size")}
    for name, sub in subs.items():
        joins = {
            k: _SMALL["hidden_size"]
            for k, v in sub.to_dict().items()
            if k != "hidden_size" and ("adapter" in k or "hidden_size" in k) and _is_int(v) and v in hidden
        }
        fields[name] = {**sub.to_dict(), **_small_fields(sub, nested=True), **joins}
    try:
        config = config_class(**fields)
        if _lists_fit(default, config):
            return config
    except Exception:
        pass
    # The class does not derive its per-layer lists from the layer count (zamba2's is a fixed
    # list of 54, lfm2_moe's comes from the default): the default's, cut to the layers kept, as
    # many as reach the first layer of each kind.
    fields.update(_small_fields(default, nested=True, each_kind=True))
    return config_class(**fields)


def _small_fields(config: Any, nested: bool = False, each_kind: bool = False) -> dict[str, Any]:
    fields = {k: v for k, v in _SMALL.items() if _settable(config, k, v)}
    if all(_has(config, k) for k in ("expand", "num_heads", "head_dim", "hidden_size")):
        # Mamba-2 mixers split hidden_size * expand into num_heads heads of head_dim.
        fields["num_heads"] = fields["hidden_size"] * config.expand // fields["head_dim"]
    if _has(config, "sliding_window") and config.sliding_window:
        fields["sliding_window"] = SHORT_WINDOW
    # A nested config is rebuilt from all its fields, so its per-layer lists (attention kinds,
    # activation sparsity, ...) are cut to the layers kept, keeping the type's pattern; a
    # top-level class derives its own (where it does not, tiny_config cuts them too).
    if nested:
        fields.update(_layer_lists(config, fields, each_kind))
    fields.update(_consistent_fields(config, fields))
    if isinstance(fields.get("per_layer_config"), dict):
        fields["per_layer_config"] = {
            k: _small_override(config, fields, v) for k, v in fields["per_layer_config"].items()
        }
    return fields


def _layer_lists(config: Any, fields: dict[str, Any], each_kind: bool) -> dict[str, Any]:
    count = next((name for name in _LAYER_COUNTS if name in fields), None)
    if count is None:
        return {}
    whole = config.to_dict()
    layers = fields[count]
    lists = _per_layer_lists(whole, count)
    out: dict[str, Any] = {}
    if each_kind:
        for value in lists.values():
            kinds = [v for v in value if isinstance(v, str)]
            if kinds:
                layers = max(layers, max(value.index(kind) for kind in set(kinds)) + 1)
    # Layers that differ from the rest (gemma4's global ones) are kept: as many layers as reach
    # the first of them.
    overrides = whole.get("per_layer_config")
    if isinstance(overrides, dict) and overrides:
        layers = max(layers, min(int(k) for k in overrides) + 1)
        out["per_layer_config"] = {k: v for k, v in overrides.items() if int(k) < layers}
    out[count] = layers
    out.update({name: value[:layers] for name, value in lists.items() if name not in fields})
    return out


def _per_layer_lists(whole: dict[str, Any], count: str) -> dict[str, list]:
    """The config's lists with one entry per layer (of the default's layer count)."""
    layers = whole.get(count)
    return {
        name: value
        for name, value in whole.items()
        if isinstance(value, list) and (len(value) == layers or name.endswith("layer_types"))
    }


def _lists_fit(default: Any, config: Any) -> bool:
    """Whether the shrunk config's per-layer lists (the default's, as its class derived them
    again) hold one entry per layer kept."""
    whole = config.to_dict()
    count = next((name for name in _LAYER_COUNTS if isinstance(whole.get(name), int)), None)
    if count is None:
        return True
    return all(
        isinstance(whole.get(name), list) and len(whole[name]) == whole[count]
        for name in _per_layer_lists(default.to_dict(), count)
    )


def _small_override(config: Any, fields: dict[str, Any], override: Any) -> Any:
    """A per-layer override (the fields in which some layers differ from the rest) shrunk as the
    rest were: each size in the same proportion to the rest's, then kept consistent (a
    latent-attention layer's head width, added where it no longer matches the rest's)."""
    if not isinstance(override, dict):
        return override
    base = config.to_dict()
    out = {
        name: max(1, fields[name] * value // base[name])
        if name in fields and _is_int(value) and _is_int(base.get(name)) and base[name] > 0
        else value
        for name, value in override.items()
    }
    consistent = _consistent_fields(SimpleNamespace(**{**base, **override}), {**fields, **out})
    out.update(
        {
            name: value
            for name, value in consistent.items()
            if name in override or value != fields.get(name, base.get(name))
        }
    )
    return out


def _default(config: Any, name: str) -> Any:
    """The config's own value of a field (None where it has none or refuses to read it whole)."""
    whole = config.to_dict() if hasattr(config, "to_dict") else vars(config)
    return whole[name] if name in whole else (getattr(config, name, None) if _has(config, name) else None)


def _is_int(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _consistent_fields(config: Any, fields: dict[str, Any]) -> dict[str, Any]:
    """Sizes that must agree with the shrunk ones: the default's values, kept, would not fit the
    small heads, layers or experts."""
    out: dict[str, Any] = {}
    # The default's values, read from its fields (a config may refuse to read a per-layer one
    # whole), under the shrunk ones.
    known = {**(config.to_dict() if hasattr(config, "to_dict") else vars(config)), **fields}

    def has(name: str) -> bool:
        return name in known or _has(config, name)

    def value(name: str) -> Any:
        return known[name] if name in known else (getattr(config, name, None) if _has(config, name) else None)

    count = next((name for name in _LAYER_COUNTS if name in fields), None)
    layers = fields[count] if count is not None else None
    # Multi-head latent attention: compressed ranks and per-head widths, the rotary part of a
    # query/key head among them (head_dim, where the config holds it, is that rotary width or the
    # whole query/key head); keys and values are expanded per query head, so there are as many
    # K/V heads as query heads.
    if value("kv_lora_rank") is not None and value("qk_rope_head_dim") is not None:
        rope, nope = 8, 16
        default_rope = _default(config, "qk_rope_head_dim")
        whole_head = {default_rope: rope, default_rope + (_default(config, "qk_nope_head_dim") or 0): rope + nope}
        if has("head_dim") and _default(config, "head_dim") in whole_head:
            out["head_dim"] = whole_head[_default(config, "head_dim")]
        out.update(qk_rope_head_dim=rope, kv_lora_rank=32)
        for name, size in (("qk_nope_head_dim", nope), ("v_head_dim", 16), ("qk_head_dim", rope + nope)):
            if has(name):
                out[name] = size
        if has("num_key_value_heads"):
            out["num_key_value_heads"] = value("num_attention_heads")
        if value("q_lora_rank") is not None:
            out["q_lora_rank"] = 48
    # A rotary width of its own (GPT-J, CodeGen) within the shrunk head.
    if value("rotary_dim") is not None:
        out["rotary_dim"] = 8
    # Grouped expert routing: groups that divide the experts, top-k groups among them.
    experts = value("n_routed_experts") or value("num_experts") or value("num_local_experts")
    if experts and (value("n_group") or 1) > 1:
        out["n_group"] = 2
        if value("topk_group") is not None:
            out["topk_group"] = 1
    # Experts per token: no more than the type routes to (zaya routes to one).
    default_top_k = getattr(config, "num_experts_per_tok", None) if _has(config, "num_experts_per_tok") else None
    if "num_experts_per_tok" in fields and _is_int(default_top_k) and default_top_k < fields["num_experts_per_tok"]:
        out["num_experts_per_tok"] = default_top_k
    # Leading dense layers: one, so the other layers are a mixture of experts.
    for name in ("first_k_dense_replace", "num_dense_layers"):
        if (value(name) or 0) > 1:
            out[name] = 1
    # Axial position embeddings (Reformer's): their widths add up to the hidden size, their
    # shape multiplies out to the longest position.
    widths, shape = value("axial_pos_embds_dim"), value("axial_pos_shape")
    if isinstance(widths, (list, tuple)) and "hidden_size" in fields:
        out["axial_pos_embds_dim"] = [w * fields["hidden_size"] // sum(widths) for w in widths]
    if isinstance(shape, (list, tuple)) and len(shape) == 2 and "max_position_embeddings" in fields:
        out["axial_pos_shape"] = [fields["max_position_embeddings"] // shape[1], shape[1]]
    # A vocabulary stored padded to vocab_size (Inkling2's): the part in use shrinks in proportion.
    unpadded, vocab = _default(config, "unpadded_vocab_size"), _default(config, "vocab_size")
    if _is_int(unpadded) and _is_int(vocab) and vocab > 0 and "vocab_size" in fields:
        out["unpadded_vocab_size"] = fields["vocab_size"] * unpadded // vocab
    # A model of language adapters (X-MOD) runs text of its first language unless told another.
    if has("default_language") and value("default_language") is None and value("languages"):
        out["default_language"] = value("languages")[0]
    if layers is not None:
        # A run-length layer pattern (GPT-Neo's [[["global", "local"], 12]]) repeated over the
        # layers kept.
        pattern = value("attention_types")
        if isinstance(pattern, list) and len(pattern) == 1 and isinstance(pattern[0], (list, tuple)):
            kinds = pattern[0][0]
            out["attention_types"] = [[kinds, max(1, layers // len(kinds))]]
        # Layers that reuse an earlier layer's K/V (Gemma-3n's last ones): all of them where all
        # are (a drafter's), else half, so that some layers produce what the others reuse.
        shared, whole = _default(config, "num_kv_shared_layers"), _default(config, count)
        if _is_int(shared) and shared > 0:
            out["num_kv_shared_layers"] = layers if shared == whole else max(1, layers // 2)
    return out


def _settable(config: Any, name: str, value: Any) -> bool:
    """Whether the config has this field and takes a value for it: a derived one (falcon's
    head_dim) or one it refuses to set (prophetnet's num_hidden_layers, xlnet's
    max_position_embeddings) is left to the config."""
    if not _has(config, name):
        return False
    attribute = getattr(type(config), name, None)
    if isinstance(attribute, property):
        try:
            attribute.__set__(copy.deepcopy(config), value)
        except Exception:
            return False
    return True


def _has(config: Any, name: str) -> bool:
    """Whether the config sets this field; a field some configs hold per layer (and refuse to
    read whole) counts as unset."""
    try:
        return hasattr(config, name)
    except Exception:
        return False


def published_class(config: Any) -> Any:
    """What a checkpoint of this type is saved as: its causal-LM class, or, where that class
    takes only a part of the config (mllama's and emu3's text half, musicgen's decoder), the
    model of the whole config whose folder people download: image-text-to-text, or text-to-audio
    (the executor serves that folder's text model, or judges it)."""
    from transformers import (
        AutoModelForCausalLM,
        AutoModelForImageTextToText,
        AutoModelForTextToWaveform,
    )
    from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING

    causal = MODEL_FOR_CAUSAL_LM_MAPPING.get(type(config), None)
    if causal is not None and not isinstance(config, causal.config_class):
        for whole in (AutoModelForImageTextToText, AutoModelForTextToWaveform):
            if type(config) in whole._model_mapping:
                return whole
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
        model = model_class.from_config(config, dtype=torch.float32, attn_implementation="eager").eval()
        with torch.no_grad():
            for parameter in model.parameters():
                if parameter.dim() >= 2:
                    parameter.normal_(0.0, 0.2)
            # The shrunk config must run in the model's own code before ours is judged on it;
            # a multimodal model's text path is judged by the executor's self-check alone (some
            # of their forwards fail on text without images in transformers' own code), a
            # drafter's by the executor alone.
            if model_class.__name__ == "AutoModelForCausalLM" and model_type not in _DRAFTERS:
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
