"""A load-generator process that stands in for a front-end: it holds N requests on one planner
through the Planner API (Connect, packed token batches), starting a new request whenever one
ends, until told to stop (SIGTERM). It tokenizes, detokenizes and streams nothing, so a benchmark
can load a planner at a rate no front-end on this machine could deliver, and measure the
planner's own cost per token (bench.scale --frontends 0).

    python -m bench.planner_load --planner HOST:PORT --token-file F --requests 4096
        [--executors 16] [--prompt-len 64] [--max-tokens 1024] [--stats-file F]

Its stats file is bench.load_generator's (the same counts and writer): tokens received so far,
requests finished and failed, and how many are delivering now (started and not ended).
"""

from __future__ import annotations

import argparse
import asyncio
import itertools
import logging
import random
import signal
import time
from pathlib import Path

import grpc

from bench.load_generator import Counts, write_stats
from protos.executor_access import read_token_file
from protos.limits import MAX_MESSAGE_BYTES
from protos.splitserve.planner.v1 import planner_pb2, planner_pb2_grpc
from protos.splitserve.v1 import generation_pb2 as pb
from protos.splitserve.v1.generation_pb2 import EXECUTOR_STATE_UP
from scheduler_service.core.sampling_params import SamplingParams
from scheduler_service.tier.planner_access import PLANNER_TOKEN_METADATA
from scheduler_service.tier.request_codec import sampling_to_proto

logger = logging.getLogger("bench.planner_load")
UP_TIMEOUT_S = 120.0


class PackedLoad:
    """Keeps `requests` requests running on one Connect stream; every ended one is replaced in
    the next batch out."""

    def __init__(self, args: argparse.Namespace) -> None:
        self._args = args
        self._rng = random.Random(args.seed)
        self._handles = itertools.count(1)
        self._outbox: asyncio.Queue[planner_pb2.FrontendBatch] = asyncio.Queue()
        # Handles of the requests that got their first token and have not ended.
        self._started: set[int] = set()
        self.counts = Counts()

    def submitted(self, count: int) -> planner_pb2.FrontendBatch:
        batch = planner_pb2.FrontendBatch()
        # As a front-end sends it: every field set, defaults applied.
        sampling = sampling_to_proto(SamplingParams(max_tokens=self._args.max_tokens, temperature=0.0, ignore_eos=True))
        for _ in range(count):
            handle = next(self._handles)
            batch.submitted.add(
                handle=handle,
                request_id=f"load-{self._args.seed}-{handle}",
                prompt_token_ids=[self._rng.randrange(1, 30_000) for _ in range(self._args.prompt_len)],
                sampling=sampling,
            )
        return batch

    def take(self, batch: planner_pb2.PlannerBatch) -> None:
        counts = self.counts
        counts.tokens += len(batch.token_ids)
        self._started.update(batch.started)
        counts.finished += len(batch.finished)
        counts.failed += len(batch.failed)
        for finished in batch.finished:
            self._started.discard(finished.handle)
        for failure in batch.failed:
            self._started.discard(failure.handle)
            logger.warning("event=request_failed code=%d message=%r", failure.code, failure.message)
        counts.delivering = len(self._started)
        ended = len(batch.finished) + len(batch.failed)
        if ended:
            self._outbox.put_nowait(self.submitted(ended))

    async def run(self, stop: asyncio.Event) -> None:
        args = self._args
        metadata = ((PLANNER_TOKEN_METADATA, read_token_file(args.token_file)),)
        options = [("grpc.max_send_message_length", MAX_MESSAGE_BYTES), ("grpc.max_receive_message_length", MAX_MESSAGE_BYTES)]
        async with grpc.aio.insecure_channel(args.planner, options) as channel:
            stub = planner_pb2_grpc.PlannerStub(channel)
            await _wait_executors_up(stub, metadata, args.executors)
            call = stub.Connect(metadata=metadata)
            hello = self.submitted(args.requests)
            hello.hello.frontend_id = f"planner-load-{args.seed}"
            await call.write(hello)
            writer = asyncio.create_task(self._write(call))
            reader = asyncio.create_task(self._read(call))
            await stop.wait()
            writer.cancel()
            reader.cancel()
            call.cancel()

    async def _read(self, call: grpc.aio.StreamStreamCall) -> None:
        while (batch := await call.read()) is not grpc.aio.EOF:
            self.take(batch)
        raise RuntimeError("the planner ended the stream")

    async def _write(self, call: grpc.aio.StreamStreamCall) -> None:
        while True:
            await call.write(await self._outbox.get())


async def _wait_executors_up(stub: planner_pb2_grpc.PlannerStub, metadata: tuple[tuple[str, str], ...], count: int) -> None:
    deadline = time.monotonic() + UP_TIMEOUT_S
    while True:
        try:
            status = await stub.GetServerStatus(pb.GetServerStatusRequest(), metadata=metadata, timeout=10)
            if sum(e.state == EXECUTOR_STATE_UP for e in status.executors) >= count:
                return
        except grpc.aio.AioRpcError as error:
            logger.info("event=planner_not_ready code=%s", error.code().name)
        if time.monotonic() > deadline:
            raise RuntimeError(f"{count} executors not up behind the planner after {UP_TIMEOUT_S} s")
        await asyncio.sleep(0.1)


async def run(args: argparse.Namespace) -> Counts:
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for signum in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(signum, stop.set)
    load = PackedLoad(args)
    stats = asyncio.create_task(write_stats(args.stats_file, load.counts)) if args.stats_file else None
    try:
        await load.run(stop)
    finally:
        if stats is not None:
            stats.cancel()
    return load.counts


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--planner", required=True, help="HOST:PORT of a planner (--role planner)")
    parser.add_argument("--token-file", type=Path, required=True, help="the planner's --planner-token-file")
    parser.add_argument("--requests", type=int, required=True, help="requests kept running at once")
    parser.add_argument("--executors", type=int, default=1, help="wait for this many executors up first")
    parser.add_argument("--prompt-len", type=int, default=64)
    parser.add_argument("--max-tokens", type=int, default=1024)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--stats-file", type=Path)
    args = parser.parse_args()
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s %(message)s")
    counts = asyncio.run(run(args))
    logger.info("event=load_done tokens=%d finished=%d failed=%d", counts.tokens, counts.finished, counts.failed)


if __name__ == "__main__":
    main()
