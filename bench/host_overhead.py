"""The executor's host work per pure decode step: everything a step costs but the model's forward
and its head (plan decoding, request state updates, building the step's inputs and attention
metadata, sampling and its bookkeeping, encoding the result). On a GPU, where a small model's
decode step takes a few milliseconds, this is what decides throughput.

    python -m bench.host_overhead [--rows 256] [--context 2048] [--steps 40] [--runs 3] [--device cpu]
        [--json OUT]

A real executor is built in this process (executor_service.startup, the default CPU path) on a
small random Llama; R requests are prefilled to C tokens each, a quarter of them sampled at
temperature 0.8 with repetition, presence and frequency penalties, the rest greedy; then every
step decodes all of them, planned as the planner plans steady decodes (packed handles). A step's
host work is ModelRunner.execute's time less compute_logits' (the model's forward and head) and
less sample_batch's (the sampler's arithmetic over [rows, vocab] logits: penalties, top-k/top-p,
the draw, the argmax), each timed in the step. On a GPU that arithmetic is device kernels whose
host cost is their launch; on this CPU it is compute like the head's, so it is reported on its
own (`sampling_us_per_step`, constant in the context) beside the host work proper
(`host_us_per_step`: plan decoding, state updates, inputs, gathering the sampling batch, penalty
count updates, result encoding) and their sum (`host_and_sampling_us_per_step`). Each is the
median over steps, then the median over runs.
"""

from __future__ import annotations

import argparse
import json
import logging
import statistics
import tempfile
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import torch

from executor_service.runner import model_runner
from executor_service.serving.settings import ExecutorSettings
from executor_service.startup.startup import ReadyExecutor, build_executor
from protos.splitserve.executor.v1 import executor_pb2 as pb
from tests.helpers.model_factory import build_model

logger = logging.getLogger("bench.host_overhead")
BLOCK_SIZE = 16
# Prompt tokens prefilled per step while the context is built.
PREFILL_TOKENS_PER_STEP = 16_384
PENALISED = pb.SamplerConfig(
    temperature=0.8, top_p=0.95, repetition_penalty=1.1, presence_penalty=0.2, frequency_penalty=0.2
)
GREEDY = pb.SamplerConfig()


@contextmanager
def timed(name: str, spent: list[float]) -> Iterator[None]:
    """Inside the block, each call the runner makes to its function `name` adds its seconds to
    spent."""
    original: Callable[..., Any] = getattr(model_runner, name)

    def clocked(*args: Any, **kwargs: Any) -> Any:
        started = time.perf_counter()
        try:
            return original(*args, **kwargs)
        finally:
            spent.append(time.perf_counter() - started)

    setattr(model_runner, name, clocked)
    try:
        yield
    finally:
        setattr(model_runner, name, original)


def _executor(model_dir: Path, rows: int, length: int, blocks_per_row: int, device: str) -> ReadyExecutor:
    """length: the most tokens a row reaches."""
    settings = ExecutorSettings(
        model_dir=model_dir, device=device, dtype="float32", block_size=BLOCK_SIZE,
        num_kv_blocks=rows * blocks_per_row, max_model_len=length, threads=1,
    )
    return build_executor(settings)


def _prefill(
    executor: ReadyExecutor, rows: int, context: int, blocks_per_row: int, generator: torch.Generator
) -> list[int]:
    """Every row's prompt computed, its blocks given for the whole run; returns the handles."""
    vocab = executor.info.vocab_size
    per_step = max(1, PREFILL_TOKENS_PER_STEP // context)
    step_id = 0
    for first in range(0, rows, per_step):
        plan = pb.StepPlan(step_id=step_id)
        step_id += 1
        for row in range(first, min(rows, first + per_step)):
            plan.new_requests.add(
                request_id=f"r{row}",
                handle=row + 1,
                token_ids=torch.randint(3, vocab, (context,), generator=generator).tolist(),
                block_ids=list(range(row * blocks_per_row, (row + 1) * blocks_per_row)),
                num_computed_tokens=0,
                num_scheduled_tokens=context,
                sampling=PENALISED if row % 4 == 0 else GREEDY,
            )
        result = executor.runner.execute(plan)
        if result.rejected or result.HasField("failure"):
            raise RuntimeError(f"the executor refused the prefill: {result.rejected or result.failure}")
    return [row + 1 for row in range(rows)]


@dataclass(slots=True)
class StepCosts:
    """Microseconds per decode step, each the median over the measured steps."""

    host_us: float
    sampling_us: float
    host_and_sampling_us: float


def measure(rows: int, context: int, steps: int, warmup: int, seed: int, device: str = "cpu") -> StepCosts:
    """Host and sampling microseconds per decode step over `steps` steps, after `warmup`."""
    generator = torch.Generator().manual_seed(seed)
    with tempfile.TemporaryDirectory(prefix="host-overhead-") as tmp:
        length = context + steps + warmup + 1
        blocks_per_row = -(-length // BLOCK_SIZE)
        model_dir = build_model("llama", Path(tmp) / "llama", seed=seed, max_position_embeddings=length)
        executor = _executor(model_dir, rows, length, blocks_per_row, device)
        handles = _prefill(executor, rows, context, blocks_per_row, generator)
        host_s: list[float] = []
        sampling_s: list[float] = []
        for index in range(warmup + steps):
            logits_s: list[float] = []
            sample_s: list[float] = []
            plan = pb.StepPlan(step_id=1_000_000 + index, decode_handles=handles)
            with timed("compute_logits", logits_s), timed("sample_batch", sample_s):
                started = time.perf_counter()
                result = executor.runner.execute(plan)
                elapsed = time.perf_counter() - started
            if len(result.decode_token_ids) != rows:
                raise RuntimeError(f"a decode step sampled {len(result.decode_token_ids)} of {rows} rows")
            if index >= warmup:
                host_s.append(elapsed - sum(logits_s) - sum(sample_s))
                sampling_s.append(sum(sample_s))
    both = [host + sampling for host, sampling in zip(host_s, sampling_s)]
    return StepCosts(*(statistics.median(values) * 1e6 for values in (host_s, sampling_s, both)))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--rows", type=int, default=256)
    parser.add_argument(
        "--device", default="cpu",
        help="where the executor runs; on cuda the forward is asynchronous (or a replayed graph), "
        "so its wait lands in the sampler's figure and host work is the launches and the bookkeeping",
    )
    parser.add_argument("--context", type=int, default=2048)
    parser.add_argument("--steps", type=int, default=40)
    parser.add_argument("--warmup", type=int, default=5)
    parser.add_argument("--runs", type=int, default=3)
    parser.add_argument("--json", type=Path, help="write the figures here")
    args = parser.parse_args()
    logging.basicConfig(level=logging.WARNING, format="%(asctime)s %(levelname)s %(name)s %(message)s")
    logger.setLevel(logging.INFO)
    per_run: list[StepCosts] = []
    for run in range(args.runs):
        per_run.append(measure(args.rows, args.context, args.steps, args.warmup, seed=run, device=args.device))
        logger.info(
            "event=host_overhead_run run=%d host_us_per_step=%.0f sampling_us_per_step=%.0f",
            run, per_run[-1].host_us, per_run[-1].sampling_us,
        )
    host_us = statistics.median(costs.host_us for costs in per_run)
    sampling_us = statistics.median(costs.sampling_us for costs in per_run)
    figures = {
        "rows": args.rows,
        "context": args.context,
        "steps": args.steps,
        "runs": [asdict(costs) for costs in per_run],
        "host_us_per_step": host_us,
        "host_us_per_row": host_us / args.rows,
        "sampling_us_per_step": sampling_us,
        "host_and_sampling_us_per_step": statistics.median(costs.host_and_sampling_us for costs in per_run),
    }
    print(
        f"{args.rows} rows at a context of {args.context}: {host_us:.0f} us of host work per decode step "
        f"({host_us / args.rows:.2f} us per row) and {sampling_us:.0f} us of sampling arithmetic, "
        f"median of {args.runs} runs of {args.steps} steps; host per run: "
        + ", ".join(f"{costs.host_us:.0f}" for costs in per_run)
    )
    if args.json is not None:
        args.json.write_text(json.dumps(figures, indent=2))


if __name__ == "__main__":
    main()
