"""Clients that read slowly or not at all, against real processes: twenty streams of 2,000 tokens
that nobody reads cost the scheduler little and give it back when their clients leave, and a
reader that falls further behind than the scheduler allows is ended with RESOURCE_EXHAUSTED, its
request stopped and its blocks freed while it is still connected."""

from __future__ import annotations

import asyncio
import time
from collections.abc import Iterator
from dataclasses import dataclass

import grpc
import pytest
import torch

from protos.splitserve.v1 import generation_pb2 as pb
from protos.splitserve.v1 import generation_pb2_grpc
from tests.helpers.executor_process import start_executor
from tests.helpers.model_factory import build_model
from tests.helpers.process_memory import rss_bytes
from tests.helpers.scheduler_process import SchedulerProcess

torch.set_num_threads(1)

STREAMS = 20
MAX_TOKENS = 2000
MAX_MODEL_LEN = 2048
BLOCK_SIZE = 16
MiB = 1 << 20
# Small enough that a stream with 20 logprobs (~140 bytes a token here) passes it within a few
# hundred tokens, large enough that one without (~4 bytes a token) never does.
BACKLOG_BYTES = 64 * 1024
# grpc's client otherwise takes a whole stream into its own buffers (probing the bandwidth-delay
# product grows its window), so the server's writes would never back up: a client that reads
# nothing keeps a 1 KB window, as a slow reader over a slow link would.
SMALL_WINDOW = [("grpc.http2.lookahead_bytes", 1024), ("grpc.http2.bdp_probe", 0)]
# Bounds far above what a healthy run needs, so that a hang fails with a message.
IDLE_BOUND_S = 300.0
SETTLE_S = 10.0


@dataclass(slots=True, frozen=True)
class Service:
    address: str
    pid: int


@pytest.fixture(scope="module")
def service(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Service]:
    model_dir = build_model(
        "llama", tmp_path_factory.mktemp("backlog") / "llama", seed=1, max_position_embeddings=MAX_MODEL_LEN
    )
    blocks = STREAMS * (MAX_MODEL_LEN // BLOCK_SIZE) + 64
    with start_executor(model_dir, num_kv_blocks=blocks, block_size=BLOCK_SIZE, max_model_len=MAX_MODEL_LEN) as (
        executor,
        _,
    ):
        scheduler = SchedulerProcess(executor, max_stream_backlog_bytes=BACKLOG_BYTES)
        try:
            yield Service(scheduler.wait_ready(timeout_s=120.0), scheduler.process.pid)
        finally:
            scheduler.close()


def generate_request(index: int, max_tokens: int = MAX_TOKENS, logprobs: int = 0) -> pb.GenerateRequest:
    return pb.GenerateRequest(
        token_ids=pb.TokenIds(ids=[5, 6, 7 + index]),
        sampling=pb.SamplingParams(max_tokens=max_tokens, ignore_eos=True, logprobs=logprobs),
    )


async def wait_until_idle(stub: generation_pb2_grpc.GenerationStub, pid: int) -> tuple[pb.ServerStatus, int]:
    """The status once nothing runs or waits, and the scheduler's largest RSS seen meanwhile."""
    deadline = time.monotonic() + IDLE_BOUND_S
    peak = rss_bytes(pid)
    while True:
        await asyncio.sleep(0.2)
        peak = max(peak, rss_bytes(pid))
        status = await stub.GetServerStatus(pb.GetServerStatusRequest())
        if status.num_running == 0 and status.num_waiting == 0:
            return status, peak
        assert time.monotonic() < deadline, f"still running after {IDLE_BOUND_S} s: {status}"


async def read_all(call: grpc.aio.UnaryStreamCall) -> tuple[int, int]:
    """Messages and tokens read until the stream ends (or fails: the error propagates)."""
    messages = tokens = 0
    async for message in call:
        messages += 1
        tokens += len(message.token_ids)
    return messages, tokens


async def lowest_rss_within(pid: int, seconds: float) -> int:
    """The least of a few readings: memory given back may take the event loop a moment."""
    lowest = rss_bytes(pid)
    for _ in range(int(seconds / 0.5)):
        await asyncio.sleep(0.5)
        lowest = min(lowest, rss_bytes(pid))
    return lowest


def test_never_reading_streams_cost_little_and_give_it_back_when_their_clients_leave(service: Service) -> None:
    async def scenario() -> tuple[int, int, int, tuple[int, int]]:
        async with grpc.aio.insecure_channel(service.address) as control:
            stub = generation_pb2_grpc.GenerationStub(control)
            # The first concurrent streams grow pools once (the allocator's arenas, grpc's
            # buffers): warmed up, the start is what the service holds at rest.
            await asyncio.gather(*(read_all(stub.Generate(generate_request(i, 50))) for i in range(STREAMS)))
            start = rss_bytes(service.pid)
            idle = grpc.aio.insecure_channel(service.address, options=SMALL_WINDOW)
            idle_stub = generation_pb2_grpc.GenerationStub(idle)
            calls = [idle_stub.Generate(generate_request(i)) for i in range(STREAMS)]
            for call in calls:
                await call.initial_metadata()
            _, peak = await wait_until_idle(stub, service.pid)
            # Every stream has finished unread; the first is read to see that the server held it.
            first = await read_all(calls[0])
            await idle.close()
            after = await lowest_rss_within(service.pid, SETTLE_S)
            return start, peak, after, first

    start, peak, after, (messages, tokens) = asyncio.run(scenario())
    # The client's window holds a few messages; the server held the rest and sent it folded.
    assert tokens == MAX_TOKENS and messages < MAX_TOKENS / 10, (messages, tokens)
    summary = f"start {start / MiB:.0f} MiB, peak {peak / MiB:.0f} MiB, after {after / MiB:.0f} MiB"
    assert peak - start < 100 * MiB, summary
    # A message per unread step held ~1.6 KB (65 MiB here) until a full collection.
    assert after - start < 20 * MiB, summary


def test_a_reader_too_far_behind_is_ended_and_its_blocks_freed_while_it_is_still_connected(
    service: Service,
) -> None:
    async def scenario() -> tuple[pb.ServerStatus, int, grpc.aio.AioRpcError]:
        async with grpc.aio.insecure_channel(service.address) as control:
            stub = generation_pb2_grpc.GenerationStub(control)
            async with grpc.aio.insecure_channel(service.address, options=SMALL_WINDOW) as slow:
                call = generation_pb2_grpc.GenerationStub(slow).Generate(generate_request(0, logprobs=20))
                await call.initial_metadata()
                status, _ = await wait_until_idle(stub, service.pid)
                tokens = 0
                try:
                    async for message in call:
                        tokens += len(message.token_ids)
                except grpc.aio.AioRpcError as error:
                    return status, tokens, error
                raise AssertionError(f"the stream ended without an error after {tokens} tokens")

    status, tokens, error = asyncio.run(scenario())
    # Nothing was read before the request stopped, and its blocks were free already.
    assert status.kv_blocks_free == status.kv_blocks_total, status
    # The tokens the client's window held before the limit, none after it.
    assert 0 < tokens < MAX_TOKENS, tokens
    assert error.code() == grpc.StatusCode.RESOURCE_EXHAUSTED, error
    details = error.details() or ""
    assert "read too slowly" in details and f"--max-stream-backlog-bytes {BACKLOG_BYTES}" in details, details
