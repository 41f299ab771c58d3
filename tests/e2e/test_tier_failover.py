"""The scheduler tier survives its own deaths (real processes): a planner killed, frozen or
stopped (SIGTERM hands over) under load is replaced by a standby planner and no client notices (greedy streams equal transformers',
seeded sampled streams equal an undisturbed run's); a front-end killed under load costs only its
own streams, and the planner lets go of everything it held for them."""

from __future__ import annotations

import asyncio
import re
import signal
import time
from collections.abc import Awaitable, Callable, Iterator
from contextlib import ExitStack
from pathlib import Path

import pytest
import torch

from clients import AsyncClient, Client
from clients.errors import SplitserveError
from protos.splitserve.v1 import generation_pb2 as pb
from tests.helpers.block_audit import assert_books_agree
from tests.helpers.executor_process import ExecutorProcess
from tests.helpers.greedy_client import stream_all, workload
from tests.helpers.greedy_reference import Reference
from tests.helpers.model_factory import build_model
from tests.helpers.scheduler_process import SchedulerProcess
from tests.helpers.service_process import is_running
from tests.helpers.tier_processes import (
    frontend,
    planner,
    planners_and_frontend,
    wait_for,
)

torch.set_num_threads(1)
EXECUTOR_FLAGS = {"num_kv_blocks": 256, "block_size": 16}


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return build_model("llama", tmp_path_factory.mktemp("tier") / "llama", seed=21)


@pytest.fixture(scope="module")
def reference(model_dir: Path) -> Reference:
    return Reference(model_dir)


@pytest.fixture(scope="module")
def planner_token(tmp_path_factory: pytest.TempPathFactory) -> Path:
    from protos.executor_access import write_token_file

    path = tmp_path_factory.mktemp("planner-token") / "token"
    write_token_file(path)
    return path


@pytest.fixture
def executors(model_dir: Path) -> Iterator[list[str]]:
    with ExitStack() as stack:
        started = [ExecutorProcess(model_dir, **EXECUTOR_FLAGS) for _ in range(2)]
        for executor in started:
            stack.callback(executor.close)
        yield [executor.wait_ready() for executor in started]


async def _sampled(
    address: str, jobs: list[tuple[list[int], int]], on_tokens: Callable[[int], None] = lambda count: None
) -> list[list[int]]:
    async with AsyncClient(address) as client:

        async def one(index: int, prompt: list[int], max_tokens: int) -> list[int]:
            tokens: list[int] = []
            async for delta in client.stream(
                prompt_token_ids=prompt, max_tokens=max_tokens, temperature=0.9, top_p=0.95,
                seed=1000 + index, ignore_eos=True,
            ):
                tokens.extend(delta.token_ids)
                on_tokens(len(delta.token_ids))
            return tokens

        return await asyncio.gather(*(one(i, p, m) for i, (p, m) in enumerate(jobs)))


Streams = Callable[[str, Callable[[int], None]], Awaitable[list[list[int]]]]


async def _with_fault(address: str, streams: Streams, fault: Callable[[], None], after_tokens: int) -> list[list[int]]:
    """Runs streams(address, on_tokens) and calls fault() the moment its clients have had
    after_tokens tokens in all. Striking on a planner's step count, seen through a status
    call, let fast streams end before the fault; the clients' own count can lag the server too
    (what is already on the wire arrives after a kill), so the tests strike within the first
    tokens of generations about a hundred steps long."""
    received = 0
    struck = False

    def on_tokens(count: int) -> None:
        nonlocal received, struck
        received += count
        if not struck and received >= after_tokens:
            struck = True
            fault()

    outputs = await streams(address, on_tokens)
    assert struck, f"the streams ended after {received} tokens, before the fault at {after_tokens}"
    return outputs


@pytest.mark.parametrize(
    "fault", ["kill", pytest.param("freeze", marks=pytest.mark.slow), pytest.param("sigterm", marks=pytest.mark.slow)]
)
def test_a_planner_lost_under_load_is_replaced_and_no_stream_notices(
    executors: list[str], reference: Reference, planner_token: Path, fault: str
) -> None:
    jobs = [(prompt, 96) for prompt, _ in workload(32, seed=55)]
    with ExitStack() as stack:
        first, front = planners_and_frontend(stack, executors, planner_token)
        address = front.wait_ready()

        def lose_the_first() -> None:
            signals = {"kill": signal.SIGKILL, "freeze": signal.SIGSTOP, "sigterm": signal.SIGTERM}
            first.process.send_signal(signals[fault])

        started = time.monotonic()
        # Struck at 32 of 32 x 96 tokens.
        outputs = asyncio.run(_with_fault(address, lambda a, heard: stream_all(a, jobs, heard), lose_the_first, 32))
        took = time.monotonic() - started
        if fault == "freeze":
            first.process.send_signal(signal.SIGKILL)
        # The standby asks a refused executor again every few seconds: both are its soon.
        wait_for(lambda: _executors_up(address) == 2, what="the standby holding both executors")
        assert_books_agree(address, audited_at_least=2)
        log = front.log_text()
    for (prompt, max_tokens), output in zip(jobs, outputs, strict=True):
        assert output == reference(prompt, max_tokens)
    assert took < 90, took
    assert "event=planner_lost" in log and "event=planner_chosen" in log


def test_seeded_sampled_streams_continue_exactly_across_a_planner_kill(
    executors: list[str], planner_token: Path
) -> None:
    jobs = [(prompt, 96) for prompt, _ in workload(16, seed=56)]
    with ExitStack() as stack:
        first, front = planners_and_frontend(stack, executors, planner_token)
        address = front.wait_ready()
        undisturbed = asyncio.run(_sampled(address, jobs))
        disturbed = asyncio.run(
            _with_fault(address, lambda a, heard: _sampled(a, jobs, heard),
                        lambda: first.process.send_signal(signal.SIGKILL), 16)
        )
    assert disturbed == undisturbed


def _executors_up(address: str) -> int:
    with Client(address) as client:
        return sum(e.state == pb.EXECUTOR_STATE_UP for e in client.server_status().executors)


def test_a_frontend_killed_under_load_costs_only_its_own_streams(
    executors: list[str], reference: Reference, planner_token: Path
) -> None:
    jobs = [(prompt, 48) for prompt, _ in workload(32, seed=57)]
    # The victim's streams run far longer than it lives, theirs past any lag of its clients.
    mine, theirs = jobs[:16], [(prompt, 400) for prompt, _ in jobs[16:]]
    with ExitStack() as stack:
        the_planner = planner(executors, planner_token)
        stack.callback(the_planner.close)
        planner_address = the_planner.wait_ready()
        wait_for(lambda: the_planner.log_text().count("state=up") >= 2, what="both executors up")
        fronts = [frontend([planner_address], planner_token) for _ in range(2)]
        for front in fronts:
            stack.callback(front.close)
        survivor, victim = (front.wait_ready() for front in fronts)

        async def both() -> tuple[list[list[int]], BaseException | list[list[int]]]:
            kept = asyncio.create_task(stream_all(survivor, mine))
            # Struck once the victim's clients have 32 of their 6,400 tokens: mid-generation.
            lost = asyncio.create_task(
                _with_fault(victim, lambda a, heard: stream_all(a, theirs, heard),
                            lambda: fronts[1].process.send_signal(signal.SIGKILL), 32)
            )
            results = await asyncio.gather(kept, lost, return_exceptions=True)
            return results[0], results[1]  # type: ignore[return-value]

        kept, lost = asyncio.run(both())
        killed_at = time.monotonic()
        assert isinstance(lost, SplitserveError), lost
        assert lost.code.name == "UNAVAILABLE"
        # Within seconds the planner holds nothing of the dead front-end's.
        wait_for(lambda: _idle(survivor), timeout_s=10.0, what="the planner to let go of the dead front-end's requests")
        assert time.monotonic() - killed_at < 10.0
        assert_books_agree(survivor, audited_at_least=2)
        log = the_planner.log_text()
    for (prompt, max_tokens), output in zip(mine, kept, strict=True):
        assert output == reference(prompt, max_tokens)
    assert re.search(r"event=frontend_disconnected frontend=\S+ aborted=\d+", log), log[-2000:]


def _idle(address: str) -> bool:
    with Client(address) as client:
        status = client.server_status()
    return status.num_running == 0 and status.num_waiting == 0 and status.kv_blocks_free == status.kv_blocks_total


def test_the_all_in_one_schedulers_front_ends_end_with_it_even_when_it_is_killed(executors: list[str]) -> None:
    scheduler = SchedulerProcess(executors[0], frontends=2)
    try:
        address = scheduler.wait_ready(timeout_s=120.0)
        with Client(address) as client:
            assert client.generate(prompt_token_ids=[5, 6, 7], max_tokens=3, ignore_eos=True).token_ids
        log = scheduler.log_text()
        pids = [int(pid) for pid in re.findall(r"event=frontend_started index=\d+ pid=(\d+)", log)]
        assert len(pids) == 2
        # By default the planner and both front-ends run on uvloop.
        assert log.count("event=event_loop loop=uvloop asked=auto") == 3, log
        scheduler.process.send_signal(signal.SIGKILL)
        wait_for(lambda: not any(is_running(pid) for pid in pids), timeout_s=20.0, what="the front-ends to end")
    finally:
        scheduler.close()
