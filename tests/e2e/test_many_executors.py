"""Several executors behind one scheduler, through real processes: outputs equal transformers'
on every executor, prompts go where their prefix is cached, an executor killed, frozen or drained
under load loses no request and no token, another model is refused, and an executor held by one
scheduler refuses another."""

from __future__ import annotations

import asyncio
import signal
import time
from collections.abc import Iterator
from contextlib import ExitStack
from pathlib import Path

import grpc
import pytest
import torch

from clients import AsyncClient, Client
from protos.splitserve.executor.v1 import executor_pb2, executor_pb2_grpc
from protos.splitserve.v1 import admin_pb2, admin_pb2_grpc
from protos.splitserve.v1 import generation_pb2 as pb
from tests.helpers.block_audit import assert_books_agree
from tests.helpers.executor_process import ExecutorProcess
from tests.helpers.greedy_client import stream_all, workload
from tests.helpers.greedy_reference import Reference
from tests.helpers.model_factory import build_model
from tests.helpers.scheduler_process import SchedulerProcess, start_scheduler
from tests.helpers.executor_token import with_token

torch.set_num_threads(1)
BLOCK_SIZE = 16
EXECUTOR_FLAGS = {"num_kv_blocks": 256, "block_size": BLOCK_SIZE}


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return build_model("llama", tmp_path_factory.mktemp("many") / "llama", seed=13)


@pytest.fixture(scope="module")
def reference(model_dir: Path) -> Reference:
    return Reference(model_dir)


@pytest.fixture
def executors(model_dir: Path) -> Iterator[list[ExecutorProcess]]:
    """Two executors of the same model, started together."""
    with ExitStack() as stack:
        started = [ExecutorProcess(model_dir, **EXECUTOR_FLAGS) for _ in range(2)]
        for executor in started:
            stack.callback(executor.close)
            # A test may leave one stopped; it must be able to exit.
            stack.callback(_continue, executor)
        for executor in started:
            executor.wait_ready()
        yield started


def _continue(executor: ExecutorProcess) -> None:
    if executor.process.poll() is None:
        executor.process.send_signal(signal.SIGCONT)


def _addresses(executors: list[ExecutorProcess]) -> list[str]:
    return [executor.wait_ready() for executor in executors]


def _status(address: str) -> pb.ServerStatus:
    with Client(address) as client:
        return client.server_status()


def _wait_for(predicate, timeout_s: float = 60.0, what: str = "condition") -> None:  # type: ignore[no-untyped-def]
    deadline = time.monotonic() + timeout_s
    while not predicate():
        assert time.monotonic() < deadline, f"timed out waiting for {what}"
        time.sleep(0.05)


def _wait_all_up(address: str, count: int) -> None:
    _wait_for(
        lambda: sum(e.state == pb.EXECUTOR_STATE_UP for e in _status(address).executors) == count,
        what=f"{count} executors up",
    )


async def _streams_with_fault(
    address: str, jobs: list[tuple[list[int], int]], fault, after_steps: int = 10  # type: ignore[no-untyped-def]
) -> list[list[int]]:
    """Streams every job; once the scheduler has run after_steps steps, calls fault()."""
    streams = asyncio.create_task(stream_all(address, jobs))
    async with AsyncClient(address) as client:
        while (await client.server_status()).num_steps < after_steps:
            await asyncio.sleep(0.02)
    fault()
    return await streams


def test_two_executors_share_64_streams_and_match_transformers(
    executors: list[ExecutorProcess], reference: Reference
) -> None:
    jobs = workload(64, seed=31)
    with start_scheduler(_addresses(executors), max_num_batched_tokens=512) as address:
        _wait_all_up(address, 2)
        outputs = asyncio.run(stream_all(address, jobs))
        status = _status(address)
    for (prompt, max_tokens), output in zip(jobs, outputs, strict=True):
        assert output == reference(prompt, max_tokens)
    assert all(e.num_steps > 0 for e in status.executors), status.executors
    assert status.kv_blocks_free == status.kv_blocks_total == 512


PREFIXES = [[100 + 50 * p + (i % 47) for i in range(12 * BLOCK_SIZE)] for p in range(4)]


def _shared_prefix_jobs(count: int, first: int = 0) -> list[tuple[list[int], int]]:
    """Requests on 4 long prefixes, each with its own tail, interleaved."""
    return [
        (PREFIXES[index % 4] + [7 + index % 97, 900 - index, 11, 12], 2)
        for index in range(first, first + count)
    ]


def _serve_shared_prefixes(address: str) -> float:
    """One request per prefix (each system prompt's first user), then 60 at once; the prefix
    cache hit rate over all of them."""
    for job in _shared_prefix_jobs(4):
        asyncio.run(stream_all(address, [job]))
    asyncio.run(stream_all(address, _shared_prefix_jobs(60, first=4)))
    return _status(address).prefix_cache_hit_rate


def test_prompts_go_to_the_executor_holding_their_prefix(
    executors: list[ExecutorProcess],
) -> None:
    addresses = _addresses(executors)
    with start_scheduler(addresses[:1]) as address:
        alone = _serve_shared_prefixes(address)
    with start_scheduler(addresses) as address:
        _wait_all_up(address, 2)
        together = _serve_shared_prefixes(address)
        spread = [e.num_steps for e in _status(address).executors]
    assert alone > 0.8
    assert together >= 0.9 * alone, f"two executors hit {together:.3f}, one alone {alone:.3f}"
    assert all(spread), f"an executor took no work: steps {spread}"


@pytest.mark.parametrize("fault", ["kill", "freeze"])
def test_an_executor_killed_or_frozen_under_load_loses_no_request_and_no_token(
    executors: list[ExecutorProcess], reference: Reference, fault: str
) -> None:
    jobs = [(prompt, 48) for prompt, _ in workload(64, seed=32)]
    victim = executors[0]
    flags = {"max_num_batched_tokens": 512, "step_timeout_floor": 5}
    with start_scheduler(_addresses(executors), **flags) as address:
        _wait_all_up(address, 2)
        started = time.monotonic()
        signum = signal.SIGKILL if fault == "kill" else signal.SIGSTOP
        outputs = asyncio.run(
            _streams_with_fault(address, jobs, lambda: victim.process.send_signal(signum))
        )
        elapsed = time.monotonic() - started
        status = _status(address)
        # The survivor's books, after it took over the lost executor's requests.
        report = assert_books_agree(address)
    for (prompt, max_tokens), output in zip(jobs, outputs, strict=True):
        assert output == reference(prompt, max_tokens)
    assert elapsed < 60, f"the streams took {elapsed:.0f} s"
    survivor = next(e for e in report.executors if e.address != victim.address)
    assert survivor.audited
    lost = next(e for e in status.executors if e.address == victim.address)
    assert lost.state != pb.EXECUTOR_STATE_UP and lost.reason
    assert status.num_preemptions >= 1 and status.num_running == status.num_waiting == 0


def test_a_second_scheduler_is_refused_and_the_first_finishes_undisturbed(
    model_dir: Path, reference: Reference
) -> None:
    jobs = [(prompt, 40) for prompt, _ in workload(16, seed=33)]
    with ExitStack() as stack:
        executor = ExecutorProcess(model_dir, **EXECUTOR_FLAGS)
        stack.callback(executor.close)
        executor_address = executor.wait_ready()
        first = stack.enter_context(start_scheduler(executor_address))
        second = SchedulerProcess(executor_address, wait_for="listening")
        stack.callback(second.close)

        def refuse_the_intruders() -> None:
            second_address = second.wait_ready()
            _wait_for(
                lambda: _status(second_address).executors[0].state == pb.EXECUTOR_STATE_REFUSED,
                what="the second scheduler to be refused",
            )
            reason = _status(second_address).executors[0].reason
            assert "held by another scheduler" in reason, reason
            # A client with the token opening a plan stream is refused the same way.
            with grpc.insecure_channel(executor_address) as channel:
                stub = executor_pb2_grpc.ExecutorStub(with_token(channel))
                results = stub.Execute(
                    iter([executor_pb2.StepPlan(step_id=1)]),
                    metadata=(("x-splitserve-scheduler-id", "intruder"),),
                )
                with pytest.raises(grpc.RpcError) as refused:
                    list(results)
            assert refused.value.code() == grpc.StatusCode.FAILED_PRECONDITION

        outputs = asyncio.run(_streams_with_fault(first, jobs, refuse_the_intruders, after_steps=3))
        status = _status(first)
    for (prompt, max_tokens), output in zip(jobs, outputs, strict=True):
        assert output == reference(prompt, max_tokens)
    assert status.num_preemptions == 0 and status.executors[0].state == pb.EXECUTOR_STATE_UP


def test_a_drained_executor_finishes_its_requests_then_takes_no_more(
    executors: list[ExecutorProcess], reference: Reference
) -> None:
    jobs = [(prompt, 40) for prompt, _ in workload(48, seed=34)]
    drained = executors[0].wait_ready()
    with start_scheduler(_addresses(executors), max_num_batched_tokens=512) as address:
        _wait_all_up(address, 2)
        with grpc.insecure_channel(address) as channel:
            admin = admin_pb2_grpc.AdminStub(channel)

            def drain() -> None:
                state = admin.DrainExecutor(admin_pb2.DrainExecutorRequest(address=drained)).state
                assert state == pb.EXECUTOR_STATE_DRAINING

            outputs = asyncio.run(_streams_with_fault(address, jobs, drain, after_steps=5))
            _wait_for(
                lambda: _executor(address, drained).state == pb.EXECUTOR_STATE_DRAINED,
                what="the drain to end",
            )
            steps_when_drained = _executor(address, drained).num_steps
            later = [(prompt, 8) for prompt, _ in workload(8, seed=35)]
            later_outputs = asyncio.run(stream_all(address, later))
            assert _executor(address, drained).num_steps == steps_when_drained
            with pytest.raises(grpc.RpcError) as unknown:
                admin.DrainExecutor(admin_pb2.DrainExecutorRequest(address="10.0.0.1:1"))
            assert unknown.value.code() == grpc.StatusCode.NOT_FOUND
            admin.ResumeExecutor(admin_pb2.ResumeExecutorRequest(address=drained))
            _wait_all_up(address, 2)
    for (prompt, max_tokens), output in [*zip(jobs, outputs), *zip(later, later_outputs)]:
        assert output == reference(prompt, max_tokens)


def test_sigterm_on_an_executor_drains_it_without_losing_a_step_of_work(
    executors: list[ExecutorProcess], reference: Reference
) -> None:
    """Kubernetes stopping an executor pod: the executor tells the scheduler on its next result,
    the scheduler moves the requests queued there to the other executor and lets the running
    ones finish, and the executor exits 0 as soon as the scheduler's stream ends."""
    jobs = [(prompt, 40) for prompt, _ in workload(48, seed=36)]
    victim, other = executors
    scheduler = SchedulerProcess(_addresses(executors), max_num_batched_tokens=512)
    try:
        address = scheduler.wait_ready()
        _wait_all_up(address, 2)
        outputs = asyncio.run(
            _streams_with_fault(address, jobs, lambda: victim.process.send_signal(signal.SIGTERM), after_steps=5)
        )
        exit_code = victim.process.wait(timeout=30)
        later = [(prompt, 8) for prompt, _ in workload(8, seed=37)]
        later_outputs = asyncio.run(stream_all(address, later))
        status = _status(address)
        # An idle executor learns of its drain from the next heartbeat plan's answer, which
        # comes within 2 s (not a third of the 30 s lease).
        other.process.send_signal(signal.SIGTERM)
        idle_exit_code = other.process.wait(timeout=8)
        scheduler_log = scheduler.log_text()
    finally:
        scheduler.close()
    for (prompt, max_tokens), output in [*zip(jobs, outputs), *zip(later, later_outputs)]:
        assert output == reference(prompt, max_tokens)
    assert exit_code == idle_exit_code == 0
    for stopped in (victim, other):
        log = stopped.log_text()
        assert "event=executor_drained" in log and "drain_timed_out" not in log, log[-2000:]
    # The executor was drained, never lost: no request had to be recomputed elsewhere.
    assert f"event=executor_shutting_down address={victim.address}" in scheduler_log
    assert f"address={victim.address} state=drained" in scheduler_log
    assert "event=executor_lost" not in scheduler_log, scheduler_log[-3000:]
    states = {e.address: e.state for e in status.executors}
    assert states == {victim.address: pb.EXECUTOR_STATE_DOWN, other.address: pb.EXECUTOR_STATE_UP}


def _executor(address: str, executor_address: str) -> pb.ExecutorStatus:
    return next(e for e in _status(address).executors if e.address == executor_address)


def test_an_executor_of_another_model_is_refused_and_the_others_serve(
    model_dir: Path, reference: Reference, tmp_path: Path
) -> None:
    """The first executor reached fixes the model; one serving another model is refused."""
    other_model = build_model("llama", tmp_path / "other", vocab_size=2000)
    jobs = workload(8, seed=36)
    with ExitStack() as stack:
        same = ExecutorProcess(model_dir, **EXECUTOR_FLAGS)
        stack.callback(same.close)
        other = ExecutorProcess(other_model, **EXECUTOR_FLAGS)
        stack.callback(other.close)
        addresses = [same.wait_ready(), other.wait_ready()]
        address = stack.enter_context(start_scheduler(addresses))
        _wait_for(
            lambda: {e.state for e in _status(address).executors}
            == {pb.EXECUTOR_STATE_UP, pb.EXECUTOR_STATE_REFUSED},
            what="one executor up and the other refused",
        )
        executors = {e.state: e for e in _status(address).executors}
        outputs = asyncio.run(stream_all(address, jobs))
    refused = executors[pb.EXECUTOR_STATE_REFUSED]
    assert "another model" in refused.reason and "1024" in refused.reason, refused.reason
    serving = reference if executors[pb.EXECUTOR_STATE_UP].address == addresses[0] else Reference(other_model)
    for (prompt, max_tokens), output in zip(jobs, outputs, strict=True):
        assert output == serving(prompt, max_tokens)
