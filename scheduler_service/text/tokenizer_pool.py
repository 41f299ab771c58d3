"""Threads that tokenize prompts off the event loop: smallest first, and never all of them on
large prompts, so a flood of large prompts cannot make a small one wait behind it.

Threads, not processes: Hugging Face's fast tokenizers release the GIL in their Rust core, so
threads encode in parallel (measured on 2 cores, Qwen3's tokenizer, 256 KiB prompts: two threads
used 1.73 cores and finished twice as many prompts per second as one), and a thread needs no copy
of the prompt where a process would pickle it both ways.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import functools
import heapq
import itertools
import logging
import os
import threading
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any, TypeVar

logger = logging.getLogger(__name__)

T = TypeVar("T")

# Jobs above this size (characters of prompt text, or token ids) are large: they may hold every
# thread but one. Tokenizing 16 Ki characters takes 15-40 ms, so a small job waits at most about
# that long for a thread, whatever the large ones do.
SMALL_JOB_SIZE = 16 << 10


def default_threads() -> int:
    """One thread per core this process may run on, and never fewer than two: one for small
    prompts beside one for large ones."""
    return max(2, len(os.sched_getaffinity(0)))


@dataclass(slots=True, order=True)
class _Job:
    size: int
    # Among jobs of one size, the first come first.
    arrival: int
    run: Callable[[], Any] = field(compare=False)
    future: concurrent.futures.Future[Any] = field(compare=False)

    @property
    def large(self) -> bool:
        return self.size > SMALL_JOB_SIZE


class TokenizerPool:
    """A fixed set of threads taking the smallest waiting job first; large jobs (over
    SMALL_JOB_SIZE) run on at most threads - 1 of them at once, so with two threads or more one
    is always left to small jobs. With one thread, small jobs wait behind a running large one."""

    def __init__(self, threads: int) -> None:
        if threads < 1:
            raise ValueError(f"a tokenizer pool needs at least one thread, not {threads}")
        self._large_slots = max(1, threads - 1)
        self._large_running = 0
        self._waiting: list[_Job] = []
        self._arrivals = itertools.count()
        self._closed = False
        self._changed = threading.Condition()
        # Daemon threads: a shutdown must not wait for a large prompt's seconds of tokenizing.
        self._threads = [
            threading.Thread(target=self._work, name=f"tokenizer-{i}", daemon=True) for i in range(threads)
        ]
        for thread in self._threads:
            thread.start()
        logger.info("event=tokenizer_pool_started threads=%d large_slots=%d", threads, self._large_slots)

    async def run(self, size: int, function: Callable[..., T], *args: Any) -> T:
        """function(*args) on a pool thread, in order of size; cancelling the await before the
        job starts drops it."""
        future: concurrent.futures.Future[T] = concurrent.futures.Future()
        job = _Job(size, next(self._arrivals), functools.partial(function, *args), future)
        with self._changed:
            if self._closed:
                raise RuntimeError("the tokenizer pool is closed")
            heapq.heappush(self._waiting, job)
            self._changed.notify_all()
        try:
            return await asyncio.wrap_future(future)
        except asyncio.CancelledError:
            self._forget(job)
            raise
        finally:
            # A raised exception's traceback holds this frame: left bound, these would make a
            # cycle (exception, frame, future, exception) that keeps the job's arguments, a
            # whole request's bytes, until the collector next runs.
            del future, job, args

    def close(self) -> None:
        """Cancels the waiting jobs; running ones finish on their daemon threads."""
        with self._changed:
            self._closed = True
            waiting, self._waiting = self._waiting, []
            self._changed.notify_all()
        for job in waiting:
            job.future.cancel()

    def _forget(self, job: _Job) -> None:
        """A cancelled job leaves the queue at once: its prompt is not kept until a thread
        would have reached it. (Not a done callback of its future: that would tie the job to
        the future that holds its exception.)"""
        if not job.future.cancelled():
            return
        with self._changed:
            if job in self._waiting:
                self._waiting.remove(job)
                heapq.heapify(self._waiting)

    def _next(self) -> _Job | None:
        with self._changed:
            while not self._closed:
                if self._waiting and (not self._waiting[0].large or self._large_running < self._large_slots):
                    job = heapq.heappop(self._waiting)
                    self._large_running += job.large
                    return job
                self._changed.wait()
            return None

    def _work(self) -> None:
        while (job := self._next()) is not None:
            try:
                if job.future.set_running_or_notify_cancel():
                    try:
                        result = job.run()
                    except BaseException as error:  # the caller's to handle, on the event loop
                        job.future.set_exception(error)
                    else:
                        job.future.set_result(result)
            finally:
                if job.large:
                    with self._changed:
                        self._large_running -= 1
                        self._changed.notify_all()
