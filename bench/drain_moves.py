"""Live migration on a drain: two mixed executors run N greedy streams of long prompts; once
every stream has its first tokens, Admin/DrainExecutor takes one of them out. Reported, median
of the runs: how long the drained executor stayed (drain call to DRAINED) against how long its
requests still had to run (drain call to the last stream's end: what a drain that waits for
them would take), the requests and blocks moved, the bytes, the rate of the whole migration
(bytes over the drain's seconds: the moves overlap, so their own seconds do not add up), and the
tokens recomputed (0 when every move succeeded); and whether every stream got exactly the tokens
of the same run without a drain.

    python -m bench.drain_moves [--model smollm2|random-smollm2|tiny|DIR] [--streams 16]
        [--prompt-tokens 300] [--max-tokens 128] [--runs 3] [--json OUT]
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
from dataclasses import asdict, dataclass
from pathlib import Path

import grpc

from bench.disaggregation import SMOLLM2, resolve_model
from bench.disaggregation_load import Prompts
from bench.disaggregation_services import MIXED, running
from clients import AsyncClient
from protos.splitserve.v1 import admin_pb2, admin_pb2_grpc
from protos.splitserve.v1 import generation_pb2 as pb
from tests.helpers.metrics_scrape import total

logger = logging.getLogger("bench.drain_moves")


@dataclass(slots=True, frozen=True)
class DrainRun:
    drained_after_s: float
    streams_ended_after_s: float
    running_when_drained: int
    moves: float
    failed_moves: float
    blocks_moved: float
    bytes_moved: float
    transfer_s: float
    recomputed_tokens: float
    exact: bool


async def _streams(address: str, jobs: list[list[int]], max_tokens: int, drain_to: str | None) -> tuple[list[list[int]], dict[str, float]]:
    """Every stream's tokens; with drain_to, the drain's timings (seconds after the drain call)."""
    timings: dict[str, float] = {}
    async with AsyncClient(address) as client:
        firsts = [asyncio.Event() for _ in jobs]

        async def one(prompt: list[int], first: asyncio.Event) -> list[int]:
            tokens: list[int] = []
            async for delta in client.stream(prompt_token_ids=prompt, max_tokens=max_tokens, temperature=0, ignore_eos=True):
                tokens += delta.token_ids
                first.set()
            return tokens

        streams = asyncio.gather(*(one(prompt, first) for prompt, first in zip(jobs, firsts, strict=True)))
        if drain_to is not None:
            for first in firsts:
                await first.wait()
            async with grpc.aio.insecure_channel(address) as channel:
                start = time.perf_counter()
                await admin_pb2_grpc.AdminStub(channel).DrainExecutor(admin_pb2.DrainExecutorRequest(address=drain_to))
            while True:
                status = await client.server_status()
                if {e.address: e.state for e in status.executors}[drain_to] == pb.EXECUTOR_STATE_DRAINED:
                    timings["drained"] = time.perf_counter() - start
                    timings["running"] = status.num_running
                    break
                await asyncio.sleep(0.01)
        outputs = await streams
        if drain_to is not None:
            timings["ended"] = time.perf_counter() - start
    return outputs, timings


def measure(model_spec: str, directory: Path, streams: int, prompt_tokens: int, max_tokens: int, run: int) -> DrainRun:
    model = resolve_model(model_spec, directory)
    prompts = Prompts(model.vocab_size, seed=run)
    jobs = [prompts.next(prompt_tokens) for _ in range(streams)]
    blocks = 2 * streams * -(-(prompt_tokens + max_tokens) // 16) + 64
    with running(model, MIXED, blocks, threads=1) as services:
        # Warm-up, and the tokens every stream must get: the same run with no drain.
        expected, _ = asyncio.run(_streams(services.address, jobs, max_tokens, None))
    with running(model, MIXED, blocks, threads=1) as services:
        asyncio.run(_streams(services.address, [prompts.next(prompt_tokens) for _ in range(2)], 8, None))
        before, _ = services.scrape()
        status_address = services.address

        async def executors() -> list[str]:
            async with AsyncClient(status_address) as client:
                return [e.address for e in (await client.server_status()).executors]

        drained = asyncio.run(executors())[0]
        outputs, timings = asyncio.run(_streams(services.address, jobs, max_tokens, drained))
        after, _ = services.scrape()
    delta = {name: total(after, name) - total(before, name) for name in (
        "splitserve:kv_blocks_migrated_total", "splitserve:kv_transfer_bytes_total",
        "splitserve:kv_transfer_seconds_sum", "splitserve:recomputed_tokens_total",
    )}
    return DrainRun(
        drained_after_s=timings["drained"],
        streams_ended_after_s=timings["ended"],
        running_when_drained=int(timings["running"]),
        moves=after.get('splitserve:kv_moves_total{outcome="ok"}', 0.0) - before.get('splitserve:kv_moves_total{outcome="ok"}', 0.0),
        failed_moves=after.get('splitserve:kv_moves_total{outcome="failed"}', 0.0) - before.get('splitserve:kv_moves_total{outcome="failed"}', 0.0),
        blocks_moved=delta["splitserve:kv_blocks_migrated_total"],
        bytes_moved=delta["splitserve:kv_transfer_bytes_total"],
        transfer_s=delta["splitserve:kv_transfer_seconds_sum"],
        recomputed_tokens=delta["splitserve:recomputed_tokens_total"],
        exact=outputs == expected,
    )


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default=SMOLLM2)
    parser.add_argument("--streams", type=int, default=16)
    parser.add_argument("--prompt-tokens", type=int, default=300)
    parser.add_argument("--max-tokens", type=int, default=128)
    parser.add_argument("--runs", type=int, default=3)
    parser.add_argument("--json", type=Path)
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(message)s")
    with tempfile.TemporaryDirectory() as directory:
        runs = [measure(args.model, Path(directory), args.streams, args.prompt_tokens, args.max_tokens, run) for run in range(args.runs)]
    def median(field: str) -> float:
        return statistics.median(getattr(run, field) for run in runs)
    print(f"model: {args.model}; {os.cpu_count()} CPU cores shared by 2 executors (--threads 1 each), the scheduler and this client")
    print(f"{args.streams} greedy streams, {args.prompt_tokens}-token prompts, {args.max_tokens} new tokens; one of 2 executors drained once every stream has tokens (median of {args.runs} runs)")
    print("| drained after s | streams ended after s | running when drained | moves | failed | blocks moved | MB moved | GB/s over the drain | recomputed tokens | exact |")
    print("|---:|---:|---:|---:|---:|---:|---:|---:|---:|---|")
    rate = statistics.median(run.bytes_moved / run.drained_after_s for run in runs) / 1e9
    print(
        f"| {median('drained_after_s'):.2f} | {median('streams_ended_after_s'):.2f} | {median('running_when_drained'):.0f} | "
        f"{median('moves'):.0f} | {median('failed_moves'):.0f} | {median('blocks_moved'):.0f} | {median('bytes_moved') / 1e6:.1f} | "
        f"{rate:.2f} | {median('recomputed_tokens'):.0f} | {all(run.exact for run in runs)} |"
    )
    for index, run in enumerate(runs):
        print(f"run {index}: {asdict(run)}")
    if args.json is not None:
        args.json.write_text(json.dumps([asdict(run) for run in runs], indent=2))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
