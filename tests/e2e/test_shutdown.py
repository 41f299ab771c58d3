"""SIGTERM as Kubernetes and meshes send it: the scheduler stops taking requests (health
NOT_SERVING, new calls UNAVAILABLE), lets the running ones finish within --drain-timeout, aborts
what is left, and exits 0; a failure exits non-zero so a supervisor restarts it."""

from __future__ import annotations

import asyncio
import signal
import time
from collections.abc import Iterator
from pathlib import Path

import grpc
import pytest
import torch
from grpc_health.v1 import health_pb2, health_pb2_grpc

from clients import AsyncClient
from clients.errors import SplitserveError
from tests.helpers.executor_process import start_executor
from tests.helpers.greedy_reference import Reference
from tests.helpers.model_factory import build_model
from tests.helpers.scheduler_process import SchedulerProcess

torch.set_num_threads(1)

PROMPTS = [[5 + i, 40, 41, 42 + i, 7] for i in range(8)]


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return build_model("llama", tmp_path_factory.mktemp("shutdown") / "llama", seed=8)


@pytest.fixture(scope="module")
def executor(model_dir: Path) -> Iterator[str]:
    with start_executor(model_dir, num_kv_blocks=512, max_model_len=1024) as (address, _):
        yield address


async def stream_tokens(client: AsyncClient, prompt: list[int], max_tokens: int, started: asyncio.Event) -> tuple[list[int], str | None]:
    tokens: list[int] = []
    finish = None
    async for delta in client.stream(prompt_token_ids=prompt, max_tokens=max_tokens, temperature=0, ignore_eos=True):
        tokens.extend(delta.token_ids)
        started.set()
        finish = delta.finish_reason
    return tokens, finish


def health_status(address: str) -> int:
    with grpc.insecure_channel(address) as channel:
        stub = health_pb2_grpc.HealthStub(channel)
        return stub.Check(health_pb2.HealthCheckRequest(), timeout=5).status


async def sigterm_under_load(
    scheduler: SchedulerProcess, address: str, max_tokens: int
) -> tuple[list[tuple[list[int], str | None]], SplitserveError, int]:
    """Streams PROMPTS, sends SIGTERM once all have tokens; returns their outputs, the error a
    request sent after the signal got, and the health status seen meanwhile."""
    async with AsyncClient(address) as client:
        events = [asyncio.Event() for _ in PROMPTS]
        streams = [
            asyncio.create_task(stream_tokens(client, prompt, max_tokens, started))
            for prompt, started in zip(PROMPTS, events, strict=True)
        ]
        for started in events:
            await asyncio.wait_for(started.wait(), 60)
        scheduler.process.send_signal(signal.SIGTERM)
        loop = asyncio.get_running_loop()
        refused = None
        deadline = time.monotonic() + 10
        # The signal is handled on the scheduler's loop turn after it arrives: until then a
        # new request may still be admitted (and then completes like the others).
        while refused is None and time.monotonic() < deadline:
            try:
                await client.generate(prompt_token_ids=[9, 9, 9], max_tokens=2)
            except SplitserveError as error:
                refused = error
        assert refused is not None, "requests were still admitted 10 s after SIGTERM"
        status = await loop.run_in_executor(None, health_status, address)
        outputs = await asyncio.gather(*streams)
    return outputs, refused, status


def test_sigterm_finishes_running_streams_refuses_new_ones_and_exits_zero(executor: str, model_dir: Path) -> None:
    scheduler = SchedulerProcess(executor)
    try:
        address = scheduler.wait_ready()
        outputs, refused, status = asyncio.run(sigterm_under_load(scheduler, address, max_tokens=150))
        exit_code = scheduler.process.wait(timeout=60)
        log = scheduler.log_text()
    finally:
        scheduler.close()
    assert refused.code == grpc.StatusCode.UNAVAILABLE and "shutting down" in refused.details
    assert status == health_pb2.HealthCheckResponse.NOT_SERVING
    reference = Reference(model_dir)
    for prompt, (tokens, finish) in zip(PROMPTS, outputs, strict=True):
        assert finish == "length"
        assert tokens == reference(prompt, 150)
    assert exit_code == 0, log[-3000:]
    assert "event=scheduler_drained left=0" in log


def test_streams_still_running_at_the_drain_timeout_are_aborted_and_the_exit_is_clean(executor: str) -> None:
    scheduler = SchedulerProcess(executor, drain_timeout=1.0)
    try:
        address = scheduler.wait_ready()
        started = time.monotonic()
        outputs, refused, _ = asyncio.run(sigterm_under_load(scheduler, address, max_tokens=1000))
        exit_code = scheduler.process.wait(timeout=60)
        stopped_after_s = time.monotonic() - started
    finally:
        scheduler.close()
    assert refused.code == grpc.StatusCode.UNAVAILABLE
    assert {finish for _, finish in outputs} == {"abort"}
    assert all(0 < len(tokens) < 1000 for tokens, _ in outputs)
    assert exit_code == 0
    assert stopped_after_s < 30


def test_a_scheduler_that_cannot_start_exits_non_zero(tmp_path: Path) -> None:
    missing = tmp_path / "no-such-cert.pem"
    scheduler = SchedulerProcess("127.0.0.1:1", wait_for="listening", tls_cert=missing, tls_key=missing)
    try:
        assert scheduler.process.wait(timeout=60) != 0
        assert "no-such-cert.pem" in scheduler.log_text()
    finally:
        scheduler.close()

