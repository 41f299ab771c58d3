"""TokenizerPool: smallest job first, a thread large jobs never take, cancellation, and the fact
the pool is built on: a Hugging Face fast tokenizer leaves the GIL to other threads while it
encodes."""

from __future__ import annotations

import asyncio
import os
import random
import string
import threading
import time
from collections.abc import Callable, Iterator

import pytest
from transformers import AutoTokenizer

from scheduler_service.__main__ import intake_limits, parse_args
from scheduler_service.text.tokenizer_pool import SMALL_JOB_SIZE, TokenizerPool
from tests.helpers.tokenizer_assets import qwen3_tokenizer_dir

LARGE = SMALL_JOB_SIZE + 1
# Generous: reached only when a job that should run waits instead.
WAIT_S = 30.0


@pytest.fixture
def pools() -> Iterator[Callable[[int], TokenizerPool]]:
    opened: list[TokenizerPool] = []

    def pool(threads: int) -> TokenizerPool:
        opened.append(TokenizerPool(threads))
        return opened[-1]

    yield pool
    for each in opened:
        each.close()


class Gate:
    """Jobs that block until opened, counting how many have started."""

    def __init__(self) -> None:
        self._open = threading.Event()
        self._lock = threading.Lock()
        self.started = 0

    def job(self, value: int) -> int:
        with self._lock:
            self.started += 1
        assert self._open.wait(WAIT_S)
        return value

    def open(self) -> None:
        self._open.set()

    def wait_started(self, count: int) -> None:
        deadline = time.monotonic() + WAIT_S
        while self.started < count:
            assert time.monotonic() < deadline, f"{self.started} of {count} jobs started"
            time.sleep(0.001)


async def occupied(pool: TokenizerPool, gate: Gate) -> asyncio.Future[int]:
    """A job that holds one of the pool's threads until the gate opens, once it runs."""
    blocker = asyncio.ensure_future(pool.run(1, gate.job, 0))
    await asyncio.to_thread(gate.wait_started, 1)
    return blocker


def test_the_smallest_waiting_job_runs_first(pools: Callable[[int], TokenizerPool]) -> None:
    pool = pools(1)
    gate = Gate()
    order: list[int] = []

    async def main() -> None:
        blocker = await occupied(pool, gate)
        queued = [asyncio.ensure_future(pool.run(size, order.append, size)) for size in (300, LARGE, 100, 200, 100)]
        await asyncio.sleep(0)  # every job is queued before the thread is free
        gate.open()
        await asyncio.gather(blocker, *queued)

    asyncio.run(main())
    assert order == [100, 100, 200, 300, LARGE]


def test_large_jobs_never_take_the_last_thread(pools: Callable[[int], TokenizerPool]) -> None:
    pool = pools(3)
    gate = Gate()

    async def main() -> None:
        large = [asyncio.ensure_future(pool.run(LARGE, gate.job, i)) for i in range(3)]
        await asyncio.to_thread(gate.wait_started, 2)
        # Two large jobs hold two threads; the third waits, and the last thread takes a small
        # job at once.
        assert await asyncio.wait_for(pool.run(SMALL_JOB_SIZE, lambda: "small"), WAIT_S) == "small"
        assert gate.started == 2
        gate.open()
        assert await asyncio.gather(*large) == [0, 1, 2]

    asyncio.run(main())


def test_errors_reach_the_caller_and_the_thread_goes_on(pools: Callable[[int], TokenizerPool]) -> None:
    pool = pools(1)

    def fail() -> None:
        raise ValueError("bad prompt")

    async def main() -> str:
        with pytest.raises(ValueError, match="bad prompt"):
            await pool.run(1, fail)
        return await pool.run(1, str.upper, "next")

    assert asyncio.run(main()) == "NEXT"


def test_a_cancelled_job_leaves_the_queue_and_never_runs(pools: Callable[[int], TokenizerPool]) -> None:
    pool = pools(1)
    gate = Gate()
    ran: list[int] = []

    async def main() -> None:
        blocker = await occupied(pool, gate)
        cancelled = asyncio.ensure_future(pool.run(LARGE, ran.append, 1))
        await asyncio.sleep(0)
        assert len(pool._waiting) == 1
        cancelled.cancel()
        await asyncio.gather(cancelled, return_exceptions=True)
        for _ in range(10):  # the cancel reaches the pool through a callback the loop runs
            await asyncio.sleep(0)
        # Its prompt is not kept until a thread would have reached it.
        assert pool._waiting == []
        gate.open()
        await blocker
        await pool.run(1, ran.append, 2)

    asyncio.run(main())
    assert ran == [2]


def test_closing_cancels_what_waits(pools: Callable[[int], TokenizerPool]) -> None:
    pool = pools(1)
    gate = Gate()

    async def main() -> None:
        blocker = await occupied(pool, gate)
        waiting = asyncio.ensure_future(pool.run(2, str, 1))
        await asyncio.sleep(0)
        pool.close()
        with pytest.raises(asyncio.CancelledError):
            await waiting
        with pytest.raises(RuntimeError, match="closed"):
            await pool.run(1, str, 1)
        gate.open()
        assert await blocker == 0

    asyncio.run(main())


def test_the_flag_sizes_the_pool_one_thread_per_core_by_default() -> None:
    assert intake_limits(parse_args([])).tokenizer_threads == max(2, len(os.sched_getaffinity(0)))
    assert intake_limits(parse_args(["--tokenizer-threads", "5"])).tokenizer_threads == 5
    with pytest.raises(SystemExit):
        parse_args(["--tokenizer-threads", "0"])


def test_tokenizing_leaves_the_gil_to_other_threads() -> None:
    """While a thread encodes 512 KiB (most of a second), this thread keeps waking up to run
    Python every millisecond: its longest pause is a small part of the encode, where a tokenizer
    holding the GIL would stop it for the whole of it. Measured: at most ~50 ms (the ids becoming
    a Python list) in an encode of 0.9 s."""
    tokenizer = AutoTokenizer.from_pretrained(qwen3_tokenizer_dir())
    rng = random.Random(0)
    text = " ".join("".join(rng.choices(string.ascii_lowercase, k=rng.randint(2, 9))) for _ in range(1 << 17))[: 1 << 19]
    elapsed: list[float] = []

    def encode() -> None:
        started = time.perf_counter()
        tokenizer.encode(text)
        elapsed.append(time.perf_counter() - started)

    worker = threading.Thread(target=encode)
    longest_pause = 0.0
    last = time.perf_counter()
    worker.start()
    while worker.is_alive():
        time.sleep(0.001)
        now = time.perf_counter()
        longest_pause = max(longest_pause, now - last)
        last = now
    worker.join()
    assert longest_pause < elapsed[0] / 4, (longest_pause, elapsed[0])
