"""What the K/V-move tests share: distinct long prompts, the scheduler's status and metrics as
they read them, and a drain started once every stream is decoding."""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable

import grpc
import torch

from clients import AsyncClient, Client
from protos.splitserve.v1 import admin_pb2, admin_pb2_grpc
from protos.splitserve.v1 import generation_pb2 as pb
from tests.helpers.greedy_client import stream_all

# Scheduler steps after which every stream of these tests is past its prompt and decoding (each
# lane's prefills and a few decodes).
STEPS_PAST_PROMPTS = 24


def distinct_prompts(count: int, length: int, max_tokens: int, seed: int) -> list[tuple[list[int], int]]:
    """Random prompts no two of which share a cached block, each with max_tokens."""
    generator = torch.Generator().manual_seed(seed)
    prompts = torch.randint(3, 250, (count, length), generator=generator).tolist()
    return [(prompt, max_tokens) for prompt in prompts]


def server_status(address: str) -> pb.ServerStatus:
    with Client(address) as client:
        return client.server_status()


def executor_state(address: str, executor: str) -> int:
    return next(e.state for e in server_status(address).executors if e.address == executor)


def wait_for(predicate: Callable[[], bool], what: str, timeout_s: float = 120.0) -> None:
    deadline = time.monotonic() + timeout_s
    while not predicate():
        assert time.monotonic() < deadline, f"timed out waiting for {what}"
        time.sleep(0.02)


async def stream_with_fault(address: str, jobs: list[tuple[list[int], int]], fault: Callable[[], None]) -> list[list[int]]:
    """Streams every job; once every stream is decoding, calls fault()."""
    streams = asyncio.create_task(stream_all(address, jobs))
    async with AsyncClient(address) as client:
        while (await client.server_status()).num_steps < STEPS_PAST_PROMPTS:
            await asyncio.sleep(0.01)
    fault()
    return await streams


def drain(address: str, executor: str) -> None:
    """Admin/DrainExecutor."""
    with grpc.insecure_channel(address) as channel:
        admin_pb2_grpc.AdminStub(channel).DrainExecutor(admin_pb2.DrainExecutorRequest(address=executor))


def wait_all_up(address: str, count: int) -> None:
    wait_for(lambda: sum(e.state == pb.EXECUTOR_STATE_UP for e in server_status(address).executors) == count, f"{count} executors up")
