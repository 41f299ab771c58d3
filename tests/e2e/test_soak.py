"""Soak: minutes of hostile clients against two executors and one scheduler, real processes.

Client tasks loop over random requests that complete, leave the stream early, hit their deadline,
lose their TCP connection mid-stream, get aborted by id from another call, or sample with a seed;
midway one executor is killed (SIGKILL) and restarted on its port. Afterwards every completed
greedy stream equals transformers' tokens, nobody met an error they did not cause, every KV
block is free on every executor, both executors serve, and the scheduler's memory stayed flat.

SPLITSERVE_SOAK_S sets the seconds of load (50 by default, to keep `make test` within its 20
minutes on 2 cores: the kill at 20 s, the restart 5 s later, 25 s of load after it and the
memory compared between 17 s and the end; `make soak` runs 1800).
"""

from __future__ import annotations

import asyncio
import logging
import os
import random
import socket
import statistics
import struct
import time
import uuid
from collections import Counter, deque
from collections.abc import Awaitable, Callable, Iterator
from contextlib import ExitStack
from dataclasses import dataclass, field
from pathlib import Path

import pytest
import torch

from clients import AsyncClient, AsyncDeltaStream, SplitserveError
from protos.splitserve.v1 import generation_pb2 as pb
from tests.helpers.executor_process import ExecutorProcess
from tests.helpers.greedy_reference import Reference
from tests.helpers.model_factory import VOCAB_SIZE, build_model
from tests.helpers.scheduler_process import SchedulerProcess
from tests.helpers.service_process import free_port

torch.set_num_threads(1)
logger = logging.getLogger(__name__)

SOAK_S = float(os.environ.get("SPLITSERVE_SOAK_S", "50"))
CLIENTS = 24
POOL_SIZE = 20
MAX_PROMPT_TOKENS = 200
MAX_TOKENS = 64
BLOCK_SIZE = 16
NUM_KV_BLOCKS = 256
EXECUTOR_FLAGS: dict[str, object] = {"num_kv_blocks": NUM_KV_BLOCKS, "block_size": BLOCK_SIZE}
# A short step timeout floor, as in the failover tests: a killed executor is noticed at once
# anyway (its connection resets), and nothing here should take seconds per step.
SCHEDULER_FLAGS: dict[str, object] = {"max_num_batched_tokens": 512, "step_timeout_floor": 5}
KILL_AT = 0.4
RESTART_AFTER_S = 5.0
# Load runs until the restarted executor is back and at least this long after, so that both
# executors step after it however long the restart took on a busy machine.
LOAD_AFTER_READMISSION_S = 10.0
FIRST_RSS_AT_S = min(60.0, SOAK_S / 3)
MAX_RSS_GROWTH = 0.10
# ... or this much, whichever is more. A scheduler without a tokenizer holds ~90 MB now that it
# loads no torch, and 10 % of that is less than what the planner of the tier (test-frontends)
# still takes in warming up under this load after the first sample (~25 MB from 17 s to 50 s;
# flat in RSS's sawtooth from about 40 s). 32 MiB is what 10 % allowed while it held ~300 MB.
MIN_RSS_GROWTH_ALLOWED_KIB = 32 << 10
# Bounds, each far above what a healthy run needs, so a hang fails with a message.
REQUEST_BOUND_S = 120.0
READMIT_BOUND_S = 120.0
# How long past its planned second the kill may wait for the victim to run a request.
VICTIM_BUSY_BOUND_S = 20.0
SETTLE_BOUND_S = 60.0
# Seeded sampling runs on a few prompts and seeds so that the same request recurs often.
SEEDED_PROMPTS = 4
SEEDS = (1, 2)
SEEDED_MAX_TOKENS = 32
KIND_WEIGHTS = {
    "complete": 30,
    "cancel": 15,
    "deadline": 15,
    "disconnect": 12,
    "abort": 15,
    "seeded": 13,
}


@dataclass(slots=True, frozen=True)
class Outcome:
    kind: str
    # How the stream ended: "completed" (finish reason length), "left" (the client left the
    # loop), "abort", a gRPC status code name, or what went wrong.
    ending: str
    # Set when the client saw what it should not have: wrong tokens, an error it did not cause.
    problem: str | None = None


@dataclass(slots=True)
class Received:
    tokens: list[int] = field(default_factory=list)
    ending: str = "left"
    detail: str = ""


async def _read(stream: AsyncDeltaStream, got: Received, until: int | None = None) -> Received:
    """Reads deltas into got until the stream ends or, given until, got holds that many tokens."""
    try:
        async for delta in stream:
            got.tokens.extend(delta.token_ids)
            if delta.finish_reason is not None:
                got.ending = "completed" if delta.finish_reason == "length" else delta.finish_reason
                return got
            if until is not None and len(got.tokens) >= until:
                return got
    except SplitserveError as error:
        got.ending, got.detail = error.code.name, error.details
        return got
    got.ending = "closed without a finish reason"
    return got


def _judge(
    kind: str, expected: list[int], got: Received, allowed: frozenset[str] = frozenset()
) -> Outcome:
    """A stream that completed must hold exactly expected; one that ended any allowed way must
    hold a prefix of it (tokens streamed before a cancel are as final as the others)."""
    if got.ending not in allowed | {"completed"}:
        return Outcome(kind, got.ending, f"{kind}: ended {got.ending} {got.detail!r}".strip())
    wanted = expected if got.ending == "completed" else expected[: len(got.tokens)]
    if got.tokens != wanted:
        return Outcome(kind, "wrong tokens", f"{kind}: {_difference(wanted, got.tokens)}")
    return Outcome(kind, got.ending)


def _difference(expected: list[int], got: list[int]) -> str:
    shorter = min(len(expected), len(got))
    first = next((i for i, (a, b) in enumerate(zip(expected, got)) if a != b), shorter)
    return f"{len(got)} tokens for {len(expected)}, first difference at {first}"


def _prompt_pool(rng: random.Random) -> list[list[int]]:
    """Prompts of 1..200 tokens; every other one starts with part of an earlier one, so running
    requests share cached prefix blocks with each other."""
    pool: list[list[int]] = []
    for index in range(POOL_SIZE):
        length = rng.randint(1, MAX_PROMPT_TOKENS)
        head = pool[rng.randrange(index)][: rng.randint(0, length)] if index % 2 else []
        pool.append(head + [rng.randrange(3, VOCAB_SIZE) for _ in range(length - len(head))])
    return pool


class Pace:
    """Deadlines drawn from how long complete requests take now: a fixed one would expire before
    the first token on a slow machine and never on a fast one."""

    def __init__(self) -> None:
        self._durations: deque[float] = deque([2.0], maxlen=32)

    def record(self, seconds: float) -> None:
        self._durations.append(seconds)

    def deadline(self, rng: random.Random) -> float:
        return rng.uniform(0.1, 1.2) * statistics.median(self._durations)


class CuttableLink:
    """A TCP relay to the scheduler whose connections can be cut at once: the scheduler sees a
    reset with no HTTP/2 stream cancel or goodbye before it, as when a client's network fails."""

    def __init__(self, target: str) -> None:
        host, port = target.rsplit(":", 1)
        self._target = (host, int(port))
        self._writers: list[asyncio.StreamWriter] = []
        self._cut = False
        self._server: asyncio.Server | None = None
        self.address = ""

    async def __aenter__(self) -> CuttableLink:
        self._server = await asyncio.start_server(self._relay, "127.0.0.1", 0)
        self.address = f"127.0.0.1:{self._server.sockets[0].getsockname()[1]}"
        return self

    async def __aexit__(self, *exc_info: object) -> None:
        self.cut()
        assert self._server is not None
        self._server.close()

    def cut(self) -> None:
        self._cut = True
        for writer in self._writers:
            _reset(writer)
        self._writers.clear()

    async def _relay(
        self, client_reader: asyncio.StreamReader, client_writer: asyncio.StreamWriter
    ) -> None:
        server_reader, server_writer = await asyncio.open_connection(*self._target)
        self._writers += [client_writer, server_writer]
        # The client's channel may dial again after a cut; it must find the network still down.
        if self._cut:
            self.cut()
        await asyncio.gather(
            _pipe(client_reader, server_writer),
            _pipe(server_reader, client_writer),
            return_exceptions=True,
        )


def _reset(writer: asyncio.StreamWriter) -> None:
    """Closes with RST rather than FIN (SO_LINGER 0), dropping whatever is unsent."""
    connection = writer.get_extra_info("socket")
    if connection is not None:
        connection.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
    writer.transport.abort()


async def _pipe(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
    while data := await reader.read(1 << 16):
        writer.write(data)
        await writer.drain()


class Load:
    """The client side of the soak: one method per kind of request, each returning its Outcome."""

    def __init__(self, address: str, pool: list[list[int]], references: list[list[int]]) -> None:
        self.address = address
        self.pool = pool
        self.references = references
        self.pace = Pace()
        self.seeded_first: dict[tuple[int, int], list[int]] = {}
        self.seeded_repeats = 0

    def _job(self, rng: random.Random, min_tokens: int = 1) -> tuple[list[int], list[int]]:
        """A random prompt of the pool with its reference cut at a random max_tokens."""
        index = rng.randrange(len(self.pool))
        return self.pool[index], self.references[index][: rng.randint(min_tokens, MAX_TOKENS)]

    @staticmethod
    def _greedy(
        client: AsyncClient, prompt: list[int], max_tokens: int, request_id: str | None = None
    ) -> AsyncDeltaStream:
        return client.stream(
            prompt_token_ids=prompt,
            max_tokens=max_tokens,
            temperature=0,
            ignore_eos=True,
            request_id=request_id,
        )

    async def complete(self, client: AsyncClient, rng: random.Random) -> Outcome:
        prompt, expected = self._job(rng)
        started = time.monotonic()
        got = await _read(self._greedy(client, prompt, len(expected)), Received())
        if got.ending == "completed":
            self.pace.record(time.monotonic() - started)
        return _judge("complete", expected, got)

    async def cancel(self, client: AsyncClient, rng: random.Random) -> Outcome:
        prompt, expected = self._job(rng, min_tokens=2)
        # Leaving the `async with` cancels the call, as a user's early break does.
        async with self._greedy(client, prompt, len(expected)) as stream:
            got = await _read(stream, Received(), until=rng.randint(1, len(expected) - 1))
        return _judge("cancel", expected, got, frozenset({"left"}))

    async def deadline(self, client: AsyncClient, rng: random.Random) -> Outcome:
        prompt, expected = self._job(rng, min_tokens=8)
        async with AsyncClient(self.address, timeout=self.pace.deadline(rng)) as hurried:
            got = await _read(self._greedy(hurried, prompt, len(expected)), Received())
        return _judge("deadline", expected, got, frozenset({"DEADLINE_EXCEEDED"}))

    async def disconnect(self, client: AsyncClient, rng: random.Random) -> Outcome:
        prompt, expected = self._job(rng, min_tokens=2)
        async with CuttableLink(self.address) as link, AsyncClient(link.address) as cut_off:
            stream = self._greedy(cut_off, prompt, len(expected))
            got = await _read(stream, Received(), until=rng.randint(1, len(expected) - 1))
            if got.ending == "left":
                link.cut()
                got = await _read(stream, got)
        return _judge("disconnect", expected, got, frozenset({"UNAVAILABLE"}))

    async def abort(self, client: AsyncClient, rng: random.Random) -> Outcome:
        prompt, expected = self._job(rng, min_tokens=2)
        request_id = f"soak-{uuid.uuid4().hex}"
        stream = self._greedy(client, prompt, len(expected), request_id=request_id)
        got = await _read(stream, Received(), until=rng.randint(1, len(expected) - 1))
        if got.ending != "left":
            return _judge("abort", expected, got)
        # Not found: it finished in between, and the stream must then complete.
        found = await client.abort(request_id)
        got = await _read(stream, got)
        return _judge("abort", expected, got, frozenset({"abort"}) if found else frozenset())

    async def seeded(self, client: AsyncClient, rng: random.Random) -> Outcome:
        """The same prompt and seed give the same tokens, whichever executor and batch run it
        and whether or not it was recomputed after a kill."""
        key = (rng.randrange(SEEDED_PROMPTS), rng.choice(SEEDS))
        stream = client.stream(
            prompt_token_ids=self.pool[key[0]],
            max_tokens=SEEDED_MAX_TOKENS,
            temperature=1.0,
            seed=key[1],
            ignore_eos=True,
        )
        got = await _read(stream, Received())
        if key in self.seeded_first:
            self.seeded_repeats += 1
            return _judge("seeded", self.seeded_first[key], got)
        if got.ending == "completed" and len(got.tokens) == SEEDED_MAX_TOKENS:
            self.seeded_first[key] = got.tokens
            return Outcome("seeded", "completed")
        return Outcome("seeded", got.ending, f"seeded: ended {got.ending} after {len(got.tokens)} tokens")

    async def client_task(self, index: int, measures: Measures) -> None:
        rng = random.Random(1000 + index)
        kinds: dict[str, Callable[[AsyncClient, random.Random], Awaitable[Outcome]]] = {
            "complete": self.complete,
            "cancel": self.cancel,
            "deadline": self.deadline,
            "disconnect": self.disconnect,
            "abort": self.abort,
            "seeded": self.seeded,
        }
        async with AsyncClient(self.address) as client:
            while measures.loading():
                kind = rng.choices(list(KIND_WEIGHTS), weights=list(KIND_WEIGHTS.values()))[0]
                try:
                    outcome = await asyncio.wait_for(kinds[kind](client, rng), REQUEST_BOUND_S)
                except TimeoutError:
                    outcome = Outcome(kind, "hung", f"{kind}: no end after {REQUEST_BOUND_S:.0f} s")
                except SplitserveError as error:
                    # A call beside the stream failed, such as Abort.
                    outcome = Outcome(kind, error.code.name, f"{kind}: {error}")
                measures.outcomes.append(outcome)


def _rss_kib(pid: int) -> int:
    with open(f"/proc/{pid}/status") as status:
        for line in status:
            if line.startswith("VmRSS:"):
                return int(line.split()[1])
    raise AssertionError(f"no VmRSS for process {pid}")


async def _status(address: str) -> pb.ServerStatus:
    async with AsyncClient(address) as client:
        return await client.server_status()


async def _wait_for_status(
    address: str, done: Callable[[pb.ServerStatus], bool], bound_s: float, what: str
) -> pb.ServerStatus:
    deadline = time.monotonic() + bound_s
    while not done(status := await _status(address)):
        assert time.monotonic() < deadline, f"no {what} after {bound_s:.0f} s: {status}"
        await asyncio.sleep(0.2)
    return status


def _all_up(status: pb.ServerStatus) -> bool:
    return len(status.executors) == 2 and all(e.state == pb.EXECUTOR_STATE_UP for e in status.executors)


def _idle_and_free(status: pb.ServerStatus) -> bool:
    """Nothing queued or running, and every executor's blocks free. A block counts as free when no
    request holds it, cached prefix blocks included (they are evicted on demand), so once all
    requests have ended, free must equal total: any block short of that is one a cancelled,
    aborted, timed-out, cut-off or moved request never gave back."""
    return (
        _all_up(status)
        and status.num_running == status.num_waiting == 0
        and all(e.num_running == e.num_waiting == 0 for e in status.executors)
        and all(e.kv_blocks_free == e.kv_blocks_total == NUM_KV_BLOCKS for e in status.executors)
    )


@dataclass(slots=True)
class Measures:
    outcomes: list[Outcome] = field(default_factory=list)
    rss_first_kib: int = 0
    rss_end_kib: int = 0
    victim_running_at_kill: int = 0
    # Each executor's steps when the killed one was back, by address.
    steps_at_readmission: dict[str, int] = field(default_factory=dict)
    final: pb.ServerStatus | None = None
    # When the clients stop sending (monotonic seconds): the planned end, or later.
    load_until: float = 0.0

    def loading(self) -> bool:
        """Until the killed executor is back (steps_at_readmission is set then) and load_until."""
        return not self.steps_at_readmission or time.monotonic() < self.load_until


class Soak:
    """Two executors on fixed ports (so one can come back where it was) and one scheduler."""

    def __init__(self, stack: ExitStack, model_dir: Path) -> None:
        self.started = time.monotonic()
        self.stack = stack
        self.model_dir = model_dir
        self.ports = [free_port(), free_port()]
        self.executors = [self._start_executor(port) for port in self.ports]
        for executor in self.executors:
            executor.wait_ready()
        addresses = [f"127.0.0.1:{port}" for port in self.ports]
        self.scheduler = SchedulerProcess(addresses, **SCHEDULER_FLAGS)
        stack.callback(self.scheduler.close)
        self.address = self.scheduler.wait_ready(timeout_s=120.0)

    def _start_executor(self, port: int) -> ExecutorProcess:
        executor = ExecutorProcess(self.model_dir, port=port, **EXECUTOR_FLAGS)
        self.stack.callback(executor.close)
        return executor

    async def kill_and_restart(self, at_s: float, measures: Measures) -> None:
        await asyncio.sleep(at_s)
        victim_address = f"127.0.0.1:{self.ports[0]}"

        def victim_of(status: pb.ServerStatus) -> pb.ExecutorStatus:
            return next(e for e in status.executors if e.address == victim_address)

        # Killed while it runs requests, so that the scheduler must move them: under this load
        # that is most moments, not every one (one run found it idle at the planned second).
        status = await _wait_for_status(
            self.address, lambda s: victim_of(s).num_running > 0, VICTIM_BUSY_BOUND_S, "request running on the victim"
        )
        before = victim_of(status)
        measures.victim_running_at_kill = before.num_running
        self.executors[0].process.kill()
        await asyncio.sleep(RESTART_AFTER_S)
        replacement = self._start_executor(self.ports[0])
        await asyncio.to_thread(replacement.wait_ready)

        def readmitted(status: pb.ServerStatus) -> bool:
            return _all_up(status) and all(
                e.incarnation_id != before.incarnation_id
                for e in status.executors
                if e.address == victim_address
            )

        status = await _wait_for_status(self.address, readmitted, READMIT_BOUND_S, "readmission")
        measures.steps_at_readmission = {e.address: e.num_steps for e in status.executors}
        measures.load_until = max(measures.load_until, time.monotonic() + LOAD_AFTER_READMISSION_S)

    async def sample_rss(self, at_s: float, measures: Measures) -> None:
        await asyncio.sleep(at_s)
        measures.rss_first_kib = _rss_kib(self.scheduler.process.pid)

    async def run(self, load: Load, seconds: float) -> Measures:
        measures = Measures()
        await _wait_for_status(self.address, _all_up, READMIT_BOUND_S, "two executors up")
        measures.load_until = time.monotonic() + seconds
        await asyncio.gather(
            self.kill_and_restart(KILL_AT * seconds, measures),
            self.sample_rss(FIRST_RSS_AT_S, measures),
            *(load.client_task(index, measures) for index in range(CLIENTS)),
        )
        measures.final = await _wait_for_status(
            self.address, _idle_and_free, SETTLE_BOUND_S, "idle scheduler with every block free"
        )
        measures.rss_end_kib = _rss_kib(self.scheduler.process.pid)
        return measures


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return build_model("llama", tmp_path_factory.mktemp("soak") / "llama", seed=17)


@pytest.fixture(scope="module")
def soak(model_dir: Path) -> Iterator[Soak]:
    with ExitStack() as stack:
        yield Soak(stack, model_dir)


def _summary(measures: Measures, load: Load, wall_s: float) -> str:
    endings = Counter((o.kind, o.ending) for o in measures.outcomes)
    per_kind = " ".join(f"{kind}/{ending}={count}" for (kind, ending), count in sorted(endings.items()))
    preemptions = measures.final.num_preemptions if measures.final else -1
    return (
        f"soak load_s={SOAK_S:.0f} wall_s={wall_s:.0f} requests={len(measures.outcomes)} "
        f"victim_running_at_kill={measures.victim_running_at_kill} preemptions={preemptions} "
        f"seeded_repeats={load.seeded_repeats} rss_first_kib={measures.rss_first_kib} "
        f"rss_end_kib={measures.rss_end_kib} {per_kind}"
    )


@pytest.mark.timeout(SOAK_S + 420)
def test_soak_with_cancels_disconnects_deadlines_and_a_killed_executor(
    soak: Soak, model_dir: Path
) -> None:
    pool = _prompt_pool(random.Random(17))
    reference = Reference(model_dir)
    load = Load(soak.address, pool, [reference(prompt, MAX_TOKENS) for prompt in pool])
    measures = asyncio.run(soak.run(load, SOAK_S))
    summary = _summary(measures, load, time.monotonic() - soak.started)
    logger.info(summary)

    failed = [o for o in measures.outcomes if o.problem is not None]
    by_ending = Counter(o.ending for o in failed)
    first = [o.problem for o in failed[:10]]
    assert not failed, f"{len(failed)} requests went wrong {dict(by_ending)}, first {first}; {summary}"
    endings = Counter((o.kind, o.ending) for o in measures.outcomes)
    # Every kind of trouble happened, or the soak proved nothing about it.
    for kind_and_ending in [
        ("complete", "completed"),
        ("cancel", "left"),
        ("deadline", "DEADLINE_EXCEEDED"),
        ("disconnect", "UNAVAILABLE"),
        ("abort", "abort"),
    ]:
        assert endings[kind_and_ending] > 0, f"no {kind_and_ending}: {summary}"
    assert load.seeded_repeats > 0, summary

    growth_kib = measures.rss_end_kib - measures.rss_first_kib
    allowed_kib = max(MAX_RSS_GROWTH * measures.rss_first_kib, MIN_RSS_GROWTH_ALLOWED_KIB)
    assert growth_kib < allowed_kib, f"scheduler RSS grew {growth_kib} KiB (allowed {allowed_kib:.0f}): {summary}"

    assert measures.final is not None
    # The kill caught requests running and the scheduler moved them (their tokens were checked).
    assert measures.final.num_preemptions >= 1, summary
    after = {e.address: e.num_steps for e in measures.final.executors}
    idle = [a for a, steps in measures.steps_at_readmission.items() if after[a] <= steps]
    assert not idle, f"no steps after the restart on {idle}: {measures.steps_at_readmission} -> {after}"
