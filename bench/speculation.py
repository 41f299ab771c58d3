"""Speculative decoding on real processes: output tokens/s with and without drafts, how many the
executor accepts, and whether the outputs stay exactly those of decoding one token at a time.

    python -m bench.speculation [--model smollm2|random-smollm2|tiny|DIR] [--requests 16]
        [--concurrency 4] [--max-tokens 160] [--k 4] [--draft-layers 8] [--runs 3]
        [--workloads quote templates] [--json OUT]

Two workloads of greedy chat requests (bench/speculation_workloads.py):

- quote: "Repeat this text exactly: <a paragraph>", --requests of them, --concurrency at a time,
  without speculation (off), with `--speculative-method ngram --num-speculative-tokens K`, and
  with `--speculative-method draft`, the executor's draft model being the model's first
  --draft-layers layers and its head (python -m executor_service.truncated_draft);
- templates: a few requests asked again with one detail changed, one at a time so the suffix
  table learns from the answers before, off, ngram and suffix.

Each pass starts its own executor (one torch thread, float32) and scheduler, warms them up with
the same two short requests, sends the workload and stops them; within a run the passes take
turns in an order that rotates from run to run. Reported, median over runs: output tokens over
the workload's wall time (first request sent to last answer), its ratio to off, acceptance
(accepted over drafted drafts, from the scheduler's spec_* metrics), mean drafts accepted per
verified request step, and whether every output equals off's in every run, and the scheduler's
block books agree with the executor's (Admin/Audit) after every pass.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import logging
import os
import statistics
import tempfile
import time
from collections.abc import Iterator
from contextlib import ExitStack, contextmanager
from dataclasses import asdict, dataclass
from pathlib import Path

import grpc

from bench.compare_models import BenchModel
from bench.disaggregation import SMOLLM2, resolve_model
from bench.speculation_workloads import (
    WARM_UP,
    Messages,
    add_workload_arguments,
    quote_requests,
    template_requests,
)
from bench.throughput_splitserve import wait_all_up
from clients import AsyncClient
from executor_service.truncated_draft import truncate
from protos.splitserve.v1 import admin_pb2, admin_pb2_grpc
from tests.helpers.executor_process import ExecutorProcess
from tests.helpers.metrics_scrape import Samples, scrape
from tests.helpers.scheduler_process import SchedulerProcess
from tests.helpers.service_process import free_port

logger = logging.getLogger("bench.speculation")
START_TIMEOUT_S = 300.0
BLOCK_SIZE = 16
NUM_KV_BLOCKS = 1024
OFF = "off"
# The passes of each workload; the first is the one every other's outputs must equal.
WORKLOADS = {"quote": (OFF, "ngram", "draft"), "templates": (OFF, "ngram", "suffix")}


@dataclass(slots=True, frozen=True)
class Pass:
    workload: str
    method: str
    run: int
    requests: int
    output_tokens: int
    seconds: float
    drafted: float
    accepted: float
    verifies: float
    audit_clean: bool

    @property
    def tokens_per_s(self) -> float:
        return self.output_tokens / self.seconds


@contextmanager
def _serving(model: BenchModel, method: str, k: int, draft: Path | None) -> Iterator[tuple[str, int]]:
    """(scheduler address, its metrics port); both processes stopped on any exit. draft: the
    executor's draft model, for the draft method."""
    with ExitStack() as stack:
        drafting = {"draft_model": draft} if method == "draft" else {}
        executor = ExecutorProcess(
            model.path, threads=1, dtype="float32", num_kv_blocks=NUM_KV_BLOCKS, block_size=BLOCK_SIZE, **drafting
        )
        stack.callback(executor.close)
        executor_address = executor.wait_ready(START_TIMEOUT_S)
        metrics_port = free_port()
        speculation = {} if method == OFF else {"speculative_method": method, "num_speculative_tokens": k}
        scheduler = SchedulerProcess([executor_address], metrics_port=metrics_port, tokenizer=model.path, **speculation)
        stack.callback(scheduler.close)
        address = scheduler.wait_ready(START_TIMEOUT_S)
        wait_all_up(address, 1)
        yield address, metrics_port


async def _send(address: str, requests: list[Messages], concurrency: int, max_tokens: int) -> tuple[list[list[int]], float]:
    """Every request's output tokens (in the order sent) and the seconds from the first sent to the last answered."""
    gate = asyncio.Semaphore(concurrency)
    async with AsyncClient(address) as client:

        async def one(messages: Messages) -> list[int]:
            async with gate:
                # repetition_penalty 1 (the model's generation_config asks for 1.1): the README's
                # figures were measured so, and a penalty holds back the repeats drafts quote.
                result = await client.generate(messages=messages, max_tokens=max_tokens, temperature=0, repetition_penalty=1.0)
                return list(result.token_ids)

        start = time.perf_counter()
        outputs = await asyncio.gather(*(one(messages) for messages in requests))
        return outputs, time.perf_counter() - start


def _spec_figures(samples: Samples, method: str) -> tuple[float, float, float]:
    """(drafted, accepted, verified request steps) so far."""
    label = f'{{method="{method}"}}'
    return (
        samples.get(f"splitserve:spec_draft_tokens_total{label}", 0.0),
        samples.get(f"splitserve:spec_accepted_tokens_total{label}", 0.0),
        samples.get(f"splitserve:spec_accepted_tokens_per_verify_count{label}", 0.0),
    )


def _audit_clean(address: str) -> bool:
    with grpc.insecure_channel(address) as channel:
        report = admin_pb2_grpc.AdminStub(channel).Audit(admin_pb2.AuditRequest(), timeout=60)
    return report.num_mismatches == 0 and any(executor.audited for executor in report.executors)


def measure_pass(
    model: BenchModel,
    workload: str,
    method: str,
    run: int,
    requests: list[Messages],
    concurrency: int,
    max_tokens: int,
    k: int,
    draft: Path | None = None,
) -> tuple[Pass, list[list[int]]]:
    with _serving(model, method, k, draft) as (address, metrics_port):
        asyncio.run(_send(address, list(WARM_UP), len(WARM_UP), 16))
        before = _spec_figures(scrape(metrics_port)[0], method)
        outputs, seconds = asyncio.run(_send(address, requests, concurrency, max_tokens))
        after = _spec_figures(scrape(metrics_port)[0], method)
        clean = _audit_clean(address)
    drafted, accepted, verifies = (a - b for a, b in zip(after, before, strict=True))
    result = Pass(workload, method, run, len(requests), sum(map(len, outputs)), seconds, drafted, accepted, verifies, clean)
    logger.info("event=pass_done %s tokens_per_s=%.1f", " ".join(f"{k}={v}" for k, v in asdict(result).items()), result.tokens_per_s)
    return result, outputs


@dataclass(slots=True, frozen=True)
class Row:
    workload: str
    method: str
    tokens_per_s: float
    ratio_to_off: float
    acceptance: float
    accepted_per_verify: float
    identical_to_off: bool
    audit_clean: bool


def summarize(passes: list[Pass], identical: dict[tuple[str, str], bool]) -> list[Row]:
    rows = []
    for workload, methods in WORKLOADS.items():
        off = [p for p in passes if p.workload == workload and p.method == OFF]
        for method in methods:
            mine = [p for p in passes if p.workload == workload and p.method == method]
            if not mine:
                continue
            by_run = {p.run: p for p in off}
            rows.append(Row(
                workload=workload,
                method=method,
                tokens_per_s=statistics.median(p.tokens_per_s for p in mine),
                ratio_to_off=statistics.median(p.tokens_per_s / by_run[p.run].tokens_per_s for p in mine),
                acceptance=statistics.median(p.accepted / p.drafted if p.drafted else 0.0 for p in mine),
                accepted_per_verify=statistics.median(p.accepted / p.verifies if p.verifies else 0.0 for p in mine),
                identical_to_off=identical[(workload, method)],
                audit_clean=all(p.audit_clean for p in mine),
            ))
    return rows


def format_table(rows: list[Row]) -> str:
    lines = [
        "| workload | speculation | output tok/s | x off | acceptance | accepted per verify | outputs identical to off | audit clean |",
        "|---|---|---:|---:|---:|---:|---|---|",
    ]
    for row in rows:
        lines.append(
            f"| {row.workload} | {row.method} | {row.tokens_per_s:.1f} | {row.ratio_to_off:.2f} | "
            f"{row.acceptance:.2f} | {row.accepted_per_verify:.2f} | {row.identical_to_off} | {row.audit_clean} |"
        )
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    add_workload_arguments(parser, SMOLLM2)
    parser.add_argument("--draft-layers", type=int, default=8, help="layers of the model the draft method's draft keeps")
    parser.add_argument("--runs", type=int, default=3)
    parser.add_argument("--workloads", nargs="+", choices=list(WORKLOADS), default=list(WORKLOADS))
    parser.add_argument("--json", type=Path)
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(message)s")
    workloads = {
        "quote": (quote_requests(args.requests), args.concurrency),
        "templates": (template_requests(args.requests), 1),
    }
    passes: list[Pass] = []
    identical: dict[tuple[str, str], bool] = {}
    with tempfile.TemporaryDirectory() as directory:
        model = resolve_model(args.model, Path(directory))
        draft = truncate(model.path, Path(directory) / "draft", args.draft_layers)
        for run in range(args.runs):
            for workload in args.workloads:
                requests, concurrency = workloads[workload]
                methods = WORKLOADS[workload]
                order = [methods[(run + index) % len(methods)] for index in range(len(methods))]
                outputs: dict[str, list[list[int]]] = {}
                for method in order:
                    result, outputs[method] = measure_pass(
                        model, workload, method, run, requests, concurrency, args.max_tokens, args.k, draft
                    )
                    passes.append(result)
                for method in methods:
                    key = (workload, method)
                    identical[key] = identical.get(key, True) and outputs[method] == outputs[OFF]
    rows = summarize(passes, identical)
    print(f"model: {args.model} ({model.description}); {os.cpu_count()} CPU cores shared by the executor (--threads 1), the scheduler and this client")
    print(
        f"greedy chat requests, up to {args.max_tokens} new tokens, K={args.k}, draft: the first {args.draft_layers} layers; "
        f"quote: {args.requests} requests "
        f"{args.concurrency} at a time; templates: {args.requests} requests one at a time; median of {args.runs} runs"
    )
    print(format_table(rows))
    if args.json is not None:
        args.json.write_text(json.dumps({"rows": [asdict(row) for row in rows], "passes": [asdict(p) for p in passes]}, indent=2))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
