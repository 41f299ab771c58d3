"""Executors are closed by default (real processes): without mutual TLS an executor takes calls
only from holders of its token, a refusal never names who holds it, a change of holder leaves no
K/V a plan could read back, and running open takes an explicit flag that says so everywhere."""

from __future__ import annotations

import asyncio
import re
import subprocess
import threading
from collections.abc import Iterator
from pathlib import Path

import grpc
import pytest

from clients import AsyncClient, Client
from protos.executor_access import EXECUTOR_TOKEN_METADATA
from protos.splitserve.executor.v1 import executor_pb2 as pb
from protos.splitserve.executor.v1 import executor_pb2_grpc as pb_grpc
from protos.splitserve.v1 import generation_pb2
from tests.helpers.executor_driver import PlanStream
from tests.helpers.executor_process import ExecutorProcess, executor_command, start_executor
from tests.helpers.executor_token import token, token_channel
from tests.helpers.greedy_reference import Reference
from tests.helpers.model_factory import build_model
from tests.helpers.scheduler_process import SchedulerProcess

BLOCK_SIZE = 16
SCHEDULER_ID = re.compile(r"event=scheduler_listening .*scheduler_id=(\S+)")


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return build_model("llama", tmp_path_factory.mktemp("access") / "llama", seed=11)


def _refused(call: object) -> grpc.RpcError:
    with pytest.raises(grpc.RpcError) as refused:
        call()  # type: ignore[operator]
    return refused.value


def _attacks(address: str, holder_id: str) -> list[grpc.StatusCode]:
    """What a stranger on the port tries, with every identity the system ever showed it."""
    codes = []
    with grpc.insecure_channel(address) as channel:
        stub = pb_grpc.ExecutorStub(channel)
        for metadata in (
            (),
            (("x-splitserve-scheduler-id", holder_id),),
            (("x-splitserve-scheduler-id", holder_id), (EXECUTOR_TOKEN_METADATA, "not-the-token-0123456789")),
            ((EXECUTOR_TOKEN_METADATA, token()[:-1]),),
        ):
            codes.append(_refused(lambda m=metadata: stub.Describe(pb.DescribeRequest(), metadata=m, timeout=10)).code())
            stream = stub.Execute(iter([pb.StepPlan(step_id=0)]), metadata=metadata, timeout=10)
            codes.append(_refused(lambda s=stream: next(s)).code())
    return codes


def test_a_stranger_is_refused_on_every_attempt_and_the_owner_is_untouched(model_dir: Path) -> None:
    reference = Reference(model_dir)
    prompt, max_tokens = [5, 9, 33, 2, 71, 8], 120
    with start_executor(model_dir, num_kv_blocks=64, block_size=BLOCK_SIZE) as (executor, _):
        scheduler = SchedulerProcess(executor)
        try:
            address = scheduler.wait_ready(timeout_s=120.0)
            holder_id = SCHEDULER_ID.search(scheduler.log_text())
            assert holder_id is not None
            codes: list[grpc.StatusCode] = []
            tokens: list[int] = []

            async def owner() -> None:
                async with AsyncClient(address) as client:
                    async for delta in client.stream(
                        prompt_token_ids=prompt, max_tokens=max_tokens, temperature=0, ignore_eos=True
                    ):
                        tokens.extend(delta.token_ids)
                        if len(tokens) >= 5 and not codes:
                            # Mid-generation, from another thread, as another process would.
                            codes.extend(await asyncio.to_thread(_attacks, executor, holder_id.group(1)))

            asyncio.run(owner())
            # A client with the token but another identity learns that someone holds it, not who.
            with token_channel(executor) as channel:
                intruder = PlanStream(channel, holder="intruder")
                refusal = _refused(lambda: intruder.step(pb.StepPlan(step_id=0)))
            scheduler_log = scheduler.log_text()
        finally:
            scheduler.close()
    assert codes == [grpc.StatusCode.UNAUTHENTICATED] * 8
    assert tokens == reference(prompt, max_tokens)
    assert "event=executor_lost" not in scheduler_log
    assert refusal.code() == grpc.StatusCode.FAILED_PRECONDITION
    assert "held by another scheduler" in refusal.details()
    assert holder_id.group(1) not in refusal.details()


def _secret_then_probe(channel: grpc.Channel, holder: str, secret: list[int]) -> None:
    """The victim: prefills a secret prompt into blocks 0..1 and leaves."""
    stream = PlanStream(channel, holder=holder)
    new = pb.NewRequest(request_id="secret", token_ids=secret, block_ids=[0, 1], num_scheduled_tokens=len(secret))
    assert stream.step(pb.StepPlan(step_id=1, new_requests=[new])).outputs
    stream.close()


def _read_blocks(channel: grpc.Channel, holder: str, secret: list[int]) -> list[float]:
    """A plan that claims blocks 0..1 hold the secret's K/V and samples the token after it:
    its logprobs are a function of whatever those blocks hold."""
    stream = PlanStream(channel, holder=holder)
    new = pb.NewRequest(
        request_id="probe",
        token_ids=[*secret, 3],
        block_ids=[0, 1, 2],
        num_computed_tokens=len(secret),
        num_scheduled_tokens=1,
        sampling=pb.SamplerConfig(want_logprobs=True, num_logprobs=5),
    )
    result = stream.step(pb.StepPlan(step_id=1, new_requests=[new]))
    stream.close()
    (output,) = result.outputs
    (record,) = output.logprobs
    return [record.logprob, *record.top_logprobs]


def test_after_a_holder_change_no_plan_reads_the_old_holders_kv(model_dir: Path) -> None:
    secret = [40 + i % 50 for i in range(2 * BLOCK_SIZE)]
    with start_executor(model_dir, num_kv_blocks=8, block_size=BLOCK_SIZE) as (executor, process):
        with token_channel(executor) as channel:
            # What reading the secret's K/V gives: the victim itself probing its own blocks.
            _secret_then_probe(channel, "victim", secret)
            readable = _read_blocks(channel, "victim", secret)
            # Another holder probing the same blocks after the victim left.
            _secret_then_probe(channel, "victim", secret)
            attacker = _read_blocks(channel, "attacker", secret)
            # Zeroed blocks, probed by a third holder: what the attacker must have seen.
            zeroed = _read_blocks(channel, "third", secret)
    assert attacker != readable
    assert attacker == zeroed


def test_an_executor_with_no_access_flags_refuses_to_start(model_dir: Path) -> None:
    command = executor_command(model_dir, executor_token_file=None)
    result = subprocess.run(command, capture_output=True, text=True, timeout=120)
    assert result.returncode == 2
    last = result.stderr.strip().splitlines()[-1]
    assert "closed by default" in last and "--executor-token-file" in last and "--insecure-executor" in last
    assert "Traceback" not in result.stderr


def test_an_insecure_executor_says_so_at_start_and_in_status(model_dir: Path) -> None:
    executor = ExecutorProcess(model_dir, num_kv_blocks=32, insecure_executor=True, executor_token_file=None)
    try:
        address = executor.wait_ready()
        assert "event=executor_insecure" in executor.log_text()
        scheduler = SchedulerProcess(address, executor_token_file=None)
        try:
            with Client(scheduler.wait_ready(timeout_s=120.0)) as client:
                (status,) = client.server_status().executors
            assert status.access == "insecure"
            assert "event=executor_insecure" in scheduler.log_text()
        finally:
            scheduler.close()
    finally:
        executor.close()


@pytest.fixture
def token_executor(model_dir: Path) -> Iterator[str]:
    with start_executor(model_dir, num_kv_blocks=32) as (address, _):
        yield address


def test_a_scheduler_without_the_token_shows_the_executor_refused_and_why(token_executor: str) -> None:
    scheduler = SchedulerProcess(token_executor, wait_for="listening", executor_token_file=None)
    try:
        with Client(scheduler.wait_ready(timeout_s=60.0)) as client:
            for _ in range(100):
                (status,) = client.server_status().executors
                if status.reason:
                    break
                threading.Event().wait(0.1)
    finally:
        scheduler.close()
    assert status.state == generation_pb2.EXECUTOR_STATE_REFUSED
    assert "UNAUTHENTICATED" in status.reason and "--executor-token-file" in status.reason
