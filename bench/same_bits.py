"""Which executor configurations give a request the same bits whatever its batch: a measurement,
for devices where invariance is not built in (CUDA: cuBLAS picks its GEMM kernels and split-K by
the number of rows, flash-attn its KV splits by the batch) and as a check of the CPU path, where
it is (docs/cpu-executor.md, "Numerics").

    python -m bench.same_bits --device cuda --dtype bfloat16 [--backends flash_attn,sdpa]
        [--graphs on,off] [--json OUT]

Per configuration (attention backend x CUDA decode graphs), an executor process, driven as the
parity tests drive one (tests/helpers/executor_driver.py), runs a probe request (greedy, top-5
logprobs) on a random SmolLM2-shaped Llama four ways: alone; in the same steps as 7 others of
random lengths; prefilled 7 tokens a step; and with its first half's tokens recomputed by one
prefill (as after a failover). It prints, per way, whether the probe's tokens
and logprobs equal the lone run's bit for bit, and the largest logprob difference. The CUDA
check (bench/cuda_check.sh) runs it; on CPU the default configuration should report every way
equal (tests/bench/test_bench_same_bits.py).
"""

from __future__ import annotations

import argparse
import json
import random
import tempfile
from dataclasses import asdict, dataclass
from pathlib import Path

from protos.splitserve.executor.v1 import executor_pb2 as pb
from tests.helpers.executor_driver import (
    BlockAllocator,
    Driver,
    PlannedRequest,
    PlanStream,
)
from tests.helpers.executor_process import start_executor
from tests.helpers.executor_token import token_channel
from tests.helpers.model_factory import build_model

BLOCK_SIZE = 16
NUM_BLOCKS = 256
MAX_MODEL_LEN = 512
PROBE_PROMPT = 40
PROBE_NEW = 16
NEIGHBOURS = 7
CHUNK = 7
# SmolLM2's vocabulary size: the head is the widest GEMM of a step.
VOCAB = 49_152
# (token id, logprob, top-5 ids, top-5 logprobs) per generated token (Driver.run_logprobs).
Trace = list[tuple[int, float, list[int], list[float]]]


@dataclass(slots=True)
class WayResult:
    """How one way of running the probe compares with the probe alone."""

    same_bits: bool
    max_logprob_diff: float


def _compare(alone: Trace, other: Trace) -> WayResult:
    diff = max(
        (abs(a - b) for x, y in zip(alone, other, strict=True) for a, b in zip((x[1], *x[3]), (y[1], *y[3]))),
        default=0.0,
    )
    return WayResult(same_bits=alone == other, max_logprob_diff=diff)


def measure(driver: Driver, vocab: int, seed: int = 0) -> dict[str, WayResult]:
    """The probe's ways, each compared with the lone run."""
    rng = random.Random(seed)
    prompt = [rng.randrange(3, vocab) for _ in range(PROBE_PROMPT)]
    sampling = pb.SamplerConfig(want_logprobs=True, num_logprobs=5)

    def probe(name: str, tokens: list[int], new: int, chunk: int | None = None) -> PlannedRequest:
        return PlannedRequest(name, tokens, new, sampling=sampling, chunk_size=chunk)

    alone = driver.run_logprobs([probe("alone", prompt, PROBE_NEW)])["alone"]
    others = [
        PlannedRequest(f"other{i}", [rng.randrange(3, vocab) for _ in range(rng.randrange(1, 3 * PROBE_PROMPT))],
                       rng.randrange(4, 2 * PROBE_NEW))
        for i in range(NEIGHBOURS)
    ]
    batched = driver.run_logprobs([probe("batched", prompt, PROBE_NEW), *others])["batched"]
    chunked = driver.run_logprobs([probe("chunked", prompt, PROBE_NEW, CHUNK)])["chunked"]
    # The first half's tokens prefilled again under a new id, as after a failover: the second
    # half must continue exactly as alone.
    half = PROBE_NEW // 2
    generated = [token for token, *_ in alone[:half]]
    recomputed = driver.run_logprobs([probe("recomputed", prompt + generated, PROBE_NEW - half)])["recomputed"]
    return {
        "batched": _compare(alone, batched),
        "chunked": _compare(alone, chunked),
        "recomputed": _compare(alone, alone[:half] + recomputed),
    }


def measure_configuration(model_dir: Path, vocab: int, **executor_flags: object) -> dict[str, WayResult]:
    """measure() against an executor process started with executor_flags (device, dtype,
    attention_backend, cuda_graph_max_batch, ...)."""
    flags = {"block_size": BLOCK_SIZE, "num_kv_blocks": NUM_BLOCKS, "max_model_len": MAX_MODEL_LEN, **executor_flags}
    with start_executor(model_dir, **flags) as (address, _), token_channel(address) as channel:
        stream = PlanStream(channel)
        try:
            return measure(Driver(stream, BLOCK_SIZE, BlockAllocator(NUM_BLOCKS)), vocab)
        finally:
            stream.close()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--dtype", default="auto")
    parser.add_argument("--backends", default="auto", help="comma-separated --attention-backend values")
    parser.add_argument("--graphs", default="off", help="on, off or on,off: CUDA decode graphs")
    parser.add_argument("--layers", type=int, default=30)
    parser.add_argument("--json", type=Path, default=None)
    args = parser.parse_args()
    results: dict[str, dict[str, dict[str, object]]] = {}
    with tempfile.TemporaryDirectory(prefix="bench-same-bits-") as tmp:
        model_dir = build_model(
            "llama", Path(tmp) / "llama", seed=3, hidden_size=576, intermediate_size=1536,
            num_hidden_layers=args.layers, num_attention_heads=9, num_key_value_heads=3, vocab_size=VOCAB,
            max_position_embeddings=MAX_MODEL_LEN,
        )
        for backend in args.backends.split(","):
            for graphs in args.graphs.split(","):
                name = f"{args.device} {args.dtype} {backend} graphs={graphs}"
                ways = measure_configuration(
                    model_dir, VOCAB, device=args.device, dtype=args.dtype, attention_backend=backend,
                    cuda_graph_max_batch=8 if graphs == "on" else 0,
                )
                results[name] = {way: asdict(result) for way, result in ways.items()}
                cells = "  ".join(
                    f"{way}: {'same' if r.same_bits else 'differs'} ({r.max_logprob_diff:.3g})" for way, r in ways.items()
                )
                print(f"{name}: {cells}", flush=True)
    if args.json is not None:
        args.json.write_text(json.dumps(results, indent=2))


if __name__ == "__main__":
    main()
