"""Which executor configurations give a request the same bits whatever its batch: a measurement,
for devices where invariance is not built in (CUDA: cuBLAS picks its GEMM kernels and split-K by
the number of rows, flash-attn its KV splits by the batch) and as a check of the CPU path, where
it is (docs/cpu-executor.md, "Numerics").

    python -m bench.same_bits --device cuda --dtype bfloat16 [--backends flash_attn,sdpa]
        [--graphs on,off] [--json OUT]

Per configuration (attention backend x CUDA decode graphs), an in-process executor runs a probe
request (greedy, top-5 logprobs) on a random SmolLM2-shaped Llama four ways: alone; in the same
steps as 7 others of random lengths; prefilled 7 tokens a step; and with its decoded positions
recomputed by one prefill (as after a failover). It prints, per way, whether the probe's tokens
and logprobs equal the lone run's bit for bit, and the largest logprob difference. The CUDA
check (bench/cuda_check.sh) runs it; on CPU the default configuration should report every way
equal (tests/bench/test_bench_same_bits.py).
"""

from __future__ import annotations

import argparse
import itertools
import json
import random
import tempfile
from dataclasses import asdict, dataclass, field
from pathlib import Path

from executor_service import startup
from executor_service.settings import ExecutorSettings
from protos.splitserve.executor.v1 import executor_pb2 as pb
from tests.helpers.model_factory import build_model

BLOCK_SIZE = 16
NUM_BLOCKS = 256
PROBE_PROMPT = 40
PROBE_NEW = 16
NEIGHBOURS = 7
CHUNK = 7
# SmolLM2's vocabulary size: the head is the widest GEMM of a step.
VOCAB = 49_152
# (token id, logprob, top-5 ids, top-5 logprobs) per generated token.
Trace = list[tuple[int, float, tuple[int, ...], tuple[float, ...]]]


@dataclass(slots=True)
class _Request:
    request_id: str
    tokens: list[int]
    prompt_len: int
    new_tokens: int
    chunk: int | None = None
    computed: int = 0
    trace: Trace = field(default_factory=list)

    @property
    def done(self) -> bool:
        return len(self.tokens) - self.prompt_len >= self.new_tokens


@dataclass(slots=True)
class WayResult:
    """How one way of running the probe compares with the probe alone."""

    same_bits: bool
    max_logprob_diff: float


class _Executor:
    """An in-process executor fed plans by a toy scheduler: every unfinished request every step."""

    def __init__(self, settings: ExecutorSettings) -> None:
        self.runner = startup.build_executor(settings).runner
        self.step_ids = itertools.count(1)
        self.finished: list[str] = []

    def serve(self, requests: list[_Request]) -> None:
        """Runs the requests (prompts in chunks where asked) until each has its tokens."""
        free = list(range(NUM_BLOCKS))
        blocks = {r.request_id: [free.pop() for _ in range(-(-(r.prompt_len + r.new_tokens) // BLOCK_SIZE))] for r in requests}
        by_id = {r.request_id: r for r in requests}
        sampling = pb.SamplerConfig(want_logprobs=True, num_logprobs=5)
        live = list(requests)
        while live:
            # Finished requests are dropped, so their blocks can be used again by the next call.
            plan = pb.StepPlan(step_id=next(self.step_ids), dropped_request_ids=self.finished)
            self.finished = []
            for request in live:
                left = len(request.tokens) - request.computed
                count = min(left, request.chunk) if request.chunk else left
                if request.computed == 0:
                    plan.new_requests.append(pb.NewRequest(
                        request_id=request.request_id, token_ids=request.tokens, block_ids=blocks[request.request_id],
                        num_scheduled_tokens=count, sampling=sampling, num_prompt_tokens=request.prompt_len,
                    ))
                else:
                    plan.continuing_requests.append(
                        pb.ContinuingRequest(request_id=request.request_id, num_scheduled_tokens=count)
                    )
                request.computed += count
            for output in self.runner.execute(plan).outputs:
                request = by_id[output.request_id]
                request.tokens.extend(output.token_ids)
                request.trace.extend(
                    (e.token_id, e.logprob, tuple(e.top_token_ids), tuple(e.top_logprobs)) for e in output.logprobs
                )
            self.finished = [r.request_id for r in live if r.done]
            live = [r for r in live if not r.done]


def _compare(alone: Trace, other: Trace) -> WayResult:
    diff = max(
        (abs(a - b) for x, y in zip(alone, other, strict=True) for a, b in zip((x[1], *x[3]), (y[1], *y[3]))),
        default=0.0,
    )
    return WayResult(same_bits=alone == other, max_logprob_diff=diff)


def measure(executor: _Executor, vocab: int, seed: int = 0) -> dict[str, WayResult]:
    """The probe's four ways, each compared with the lone run."""
    rng = random.Random(seed)
    prompt = [rng.randrange(3, vocab) for _ in range(PROBE_PROMPT)]

    def probe(name: str, chunk: int | None = None) -> _Request:
        return _Request(name, list(prompt), PROBE_PROMPT, PROBE_NEW, chunk)

    alone = probe("alone")
    executor.serve([alone])
    batched = probe("batched")
    others = [
        _Request(f"other{i}", [rng.randrange(3, vocab) for _ in range(length)], length, rng.randrange(4, 2 * PROBE_NEW))
        for i, length in enumerate(rng.randrange(1, 3 * PROBE_PROMPT) for _ in range(NEIGHBOURS))
    ]
    executor.serve([batched, *others])
    chunked = probe("chunked", CHUNK)
    executor.serve([chunked])
    # The first half decoded, then everything so far prefilled again under a new id, as after a
    # failover: the second half must continue exactly as alone.
    half = PROBE_NEW // 2
    first = _Request("first-half", list(prompt), PROBE_PROMPT, half)
    executor.serve([first])
    again = _Request("recomputed", list(first.tokens), PROBE_PROMPT, PROBE_NEW)
    executor.serve([again])
    return {
        "batched": _compare(alone.trace, batched.trace),
        "chunked": _compare(alone.trace, chunked.trace),
        "recomputed": _compare(alone.trace, first.trace + again.trace),
    }


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
            max_position_embeddings=512,
        )
        for backend in args.backends.split(","):
            for graphs in args.graphs.split(","):
                settings = ExecutorSettings(
                    model_dir=model_dir, device=args.device, dtype=args.dtype, block_size=BLOCK_SIZE,
                    num_kv_blocks=NUM_BLOCKS, max_model_len=512, attention_backend=backend,
                    cuda_graph_max_batch=8 if graphs == "on" else 0,
                )
                name = f"{args.device} {args.dtype} {backend} graphs={graphs}"
                ways = measure(_Executor(settings), VOCAB)
                results[name] = {way: asdict(result) for way, result in ways.items()}
                cells = "  ".join(
                    f"{way}: {'same' if r.same_bits else 'differs'} ({r.max_logprob_diff:.3g})" for way, r in ways.items()
                )
                print(f"{name}: {cells}", flush=True)
    if args.json is not None:
        args.json.write_text(json.dumps(results, indent=2))


if __name__ == "__main__":
    main()
