"""Output tokens/s of splitserve end to end against transformers' static batched `generate`, on
the same random-weight Llama, prompts and CPU threads, measured in one run on one machine.

    python -m bench.throughput [--requests 32] [--new-tokens 128] [--min-prompt 32]
        [--max-prompt 512] [--hidden 512] [--layers 8] [--heads 8] [--kv-heads 4]
        [--intermediate 1408] [--vocab 32000] [--threads 2] [--executors 1] [--seed 0] [--max-num-batched-tokens 2048]
        [--arch llama|qwen3_next]

Timings on shared machines are noisy: read the ratios, not the absolute speeds. Greedy outputs
are compared too; a left-padded static batch may differ from unpadded runs on a rare near-tie.
"""

from __future__ import annotations

import argparse
import logging
import signal
import sys
import tempfile
from dataclasses import dataclass, fields
from pathlib import Path
from types import FrameType

from bench.throughput_peer import run_transformers
from bench.throughput_splitserve import run_splitserve
from bench.throughput_workload import BenchConfig, SystemResult, make_prompts
from tests.helpers.model_factory import build_model

logger = logging.getLogger("bench.throughput")


@dataclass(slots=True, frozen=True)
class BenchResult:
    config: BenchConfig
    splitserve: SystemResult
    transformers: SystemResult
    # Requests whose splitserve output equals transformers' token for token.
    matching: int
    arch: str = "llama"


ARCHITECTURES = ("llama", "qwen3_next")


def build_bench_model(
    config: BenchConfig, directory: Path, max_positions: int | None = None, arch: str = "llama"
) -> Path:
    """The random model of config's dimensions, with room for max_positions tokens (default:
    the longest request of config's workload). arch qwen3_next: Qwen3-Next's shape at these
    dimensions (three Gated DeltaNet layers to one attention layer, its linear-attention heads
    in the published model's proportions, a dense MLP in place of its experts)."""
    shape = {}
    if arch == "qwen3_next":
        head_dim = config.hidden // config.heads
        shape = {
            "head_dim": head_dim,
            "layer_types": ["full_attention" if (i + 1) % 4 == 0 else "linear_attention" for i in range(config.layers)],
            "linear_num_key_heads": max(1, config.heads // 2),
            "linear_num_value_heads": config.heads,
            "linear_key_head_dim": head_dim,
            "linear_value_head_dim": head_dim,
        }
    return build_model(
        arch,
        directory,
        seed=config.seed,
        hidden_size=config.hidden,
        intermediate_size=config.intermediate,
        num_hidden_layers=config.layers,
        num_attention_heads=config.heads,
        num_key_value_heads=config.kv_heads,
        vocab_size=config.vocab,
        max_position_embeddings=max_positions or config.max_model_len,
        **shape,
    )


def run_benchmark(config: BenchConfig, arch: str = "llama") -> BenchResult:
    """Builds the model, runs splitserve then transformers (never both at once: they share the
    CPUs), and compares their outputs."""
    prompts = make_prompts(config)
    with tempfile.TemporaryDirectory(prefix="bench-throughput-") as tmp:
        model_dir = build_bench_model(config, Path(tmp) / arch, arch=arch)
        ours = run_splitserve(model_dir, prompts, config)
        peer = run_transformers(model_dir, prompts, [config.new_tokens] * len(prompts), config.threads)
    matching = sum(a == b for a, b in zip(ours.outputs, peer.outputs))
    return BenchResult(config, ours, peer, matching, arch)


def format_table(result: BenchResult) -> str:
    c = result.config
    lines = [
        f"{c.requests} requests, prompts {c.min_prompt}-{c.max_prompt} tokens, {c.new_tokens} new tokens; "
        f"random {result.arch} hidden {c.hidden} x {c.layers} layers, {c.heads}/{c.kv_heads} heads, "
        f"MLP {c.intermediate}, vocab {c.vocab}; fp32, {c.threads} threads",
        "| system | wall s | output tok/s | ratio to transformers | TTFT p50 s |",
        "|---|---:|---:|---:|---:|",
    ]
    base = result.transformers.tokens_per_s
    for r in (result.splitserve, result.transformers):
        lines.append(
            f"| {r.system} | {r.wall_s:.2f} | {r.tokens_per_s:.1f} | {r.tokens_per_s / base:.2f} | {r.ttft_p50_s:.2f} |"
        )
    lines.append(f"greedy outputs equal to transformers': {result.matching}/{c.requests} requests")
    return "\n".join(lines)


def parse_args(argv: list[str] | None) -> tuple[BenchConfig, str]:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    for f in fields(BenchConfig):
        if f.name != "block_size":
            parser.add_argument(f"--{f.name.replace('_', '-')}", type=int, default=f.default)
    parser.add_argument("--arch", choices=ARCHITECTURES, default="llama", help="the random model's architecture")
    args = vars(parser.parse_args(argv))
    arch = args.pop("arch")
    return BenchConfig(**args), arch


def exit_on_sigterm(signum: int, frame: FrameType | None) -> None:
    # Unwinds through the context managers, so child services and peers are stopped too.
    raise SystemExit(128 + signum)


def main(argv: list[str] | None = None) -> int:
    logging.basicConfig(
        level=logging.INFO, stream=sys.stderr, format="%(asctime)s level=%(levelname)s logger=%(name)s %(message)s"
    )
    config, arch = parse_args(argv)
    signal.signal(signal.SIGTERM, exit_on_sigterm)
    result = run_benchmark(config, arch)
    print(format_table(result))
    return 0


if __name__ == "__main__":
    sys.exit(main())
