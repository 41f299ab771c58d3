"""The executor process as a server: Describe, health, reflection, streams and shutdown."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import grpc
import pytest
import torch
from grpc_health.v1 import health_pb2, health_pb2_grpc
from grpc_reflection.v1alpha import reflection_pb2, reflection_pb2_grpc

from executor_service.attention.paged_attention import select_backend
from protos.splitserve.executor.v1 import executor_pb2 as pb
from protos.splitserve.executor.v1 import executor_pb2_grpc as pb_grpc
from tests.helpers.executor_driver import PlanStream
from tests.helpers.executor_process import ExecutorProcess, start_executor
from tests.helpers.executor_token import token_channel, with_token
from tests.helpers.model_factory import EOS_TOKEN_ID, VOCAB_SIZE, build_model

SERVICE = "splitserve.executor.v1.Executor"
NUM_BLOCKS = 32
BLOCK_SIZE = 8


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return build_model("llama", tmp_path_factory.mktemp("llama"))


@pytest.fixture(scope="module")
def served(model_dir: Path) -> Iterator[tuple[grpc.Channel, int]]:
    """A channel to an executor with one torch thread, and its pid."""
    with start_executor(model_dir, num_kv_blocks=NUM_BLOCKS, block_size=BLOCK_SIZE) as (address, process):
        with grpc.insecure_channel(address) as plain:
            yield with_token(plain), process.pid


@pytest.fixture(scope="module")
def channel(served: tuple[grpc.Channel, int]) -> grpc.Channel:
    return served[0]


def test_describe(channel: grpc.Channel, model_dir: Path) -> None:
    info = pb_grpc.ExecutorStub(channel).Describe(pb.DescribeRequest())
    assert info.model_id == str(model_dir)
    assert info.vocab_size == VOCAB_SIZE
    assert list(info.eos_token_ids) == [EOS_TOKEN_ID]
    # The model allows 1024 positions, but the whole cache holds only 256 tokens.
    assert info.max_model_len == NUM_BLOCKS * BLOCK_SIZE
    assert (info.block_size, info.num_kv_blocks) == (BLOCK_SIZE, NUM_BLOCKS)
    assert (info.dtype, info.device) == ("float32", "cpu")
    # auto: the decode kernel wherever this machine can build it.
    assert info.attention_backend == select_backend(torch.device("cpu"), torch.float32)
    assert len(info.incarnation_id) == 32
    assert info.max_logprobs == 20


def test_health_and_reflection(channel: grpc.Channel) -> None:
    health = health_pb2_grpc.HealthStub(channel)
    for service in ("", SERVICE):
        response = health.Check(health_pb2.HealthCheckRequest(service=service))
        assert response.status == health_pb2.HealthCheckResponse.SERVING
    reflection = reflection_pb2_grpc.ServerReflectionStub(channel)
    (answer,) = reflection.ServerReflectionInfo(
        iter([reflection_pb2.ServerReflectionRequest(list_services="")])
    )
    names = {s.name for s in answer.list_services_response.service}
    assert {SERVICE, "grpc.health.v1.Health"} <= names


def test_bad_step_ids_end_a_stream_and_a_new_stream_starts_from_no_state(
    channel: grpc.Channel,
) -> None:
    first = PlanStream(channel)
    new = pb.NewRequest(
        request_id="kept", token_ids=[5, 6, 7], block_ids=[0], num_scheduled_tokens=3
    )
    assert first.step(pb.StepPlan(step_id=10, new_requests=[new])).outputs[0].token_ids
    first.send(pb.StepPlan(step_id=10))
    with pytest.raises(grpc.RpcError) as error:
        first.receive()
    assert error.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert "step_id" in error.value.details()

    # A new stream starts its own step ids, and from no request state: whoever opens it
    # resends what it wants run (a scheduler that reconnects recomputes its requests anyway).
    second = PlanStream(channel)
    decode = pb.ContinuingRequest(request_id="kept", num_scheduled_tokens=1)
    result = second.step(pb.StepPlan(step_id=1, continuing_requests=[decode]))
    assert [r.request_id for r in result.rejected] == ["kept"]
    assert "unknown request" in result.rejected[0].message
    second.step(pb.StepPlan(step_id=2, new_requests=[new]))
    # Describe answers while plans are queued on the stream.
    for step in range(3, 7):
        second.send(pb.StepPlan(step_id=step, continuing_requests=[decode]))
    assert pb_grpc.ExecutorStub(channel).Describe(pb.DescribeRequest()).num_kv_blocks == NUM_BLOCKS
    assert [second.receive().step_id for _ in range(3, 7)] == [3, 4, 5, 6]
    second.step(pb.StepPlan(step_id=7, dropped_request_ids=["kept"]))
    second.close()


def test_kv_memory_budget_and_clean_sigterm(model_dir: Path) -> None:
    # 2 layers x K,V x 16 tokens x 2 KV heads x 16 dims x 4 bytes = 8 KiB per block.
    executor = ExecutorProcess(model_dir, kv_cache_memory="1MiB", block_size=16)
    try:
        with token_channel(executor.wait_ready()) as channel:
            info = pb_grpc.ExecutorStub(channel).Describe(pb.DescribeRequest())
        assert info.num_kv_blocks == 128
        assert executor.stop() == 0
        assert "event=executor_stopped" in executor.log_text()
    finally:
        executor.close()


def test_a_new_stream_supersedes_the_active_one(channel: grpc.Channel) -> None:
    prompt = pb.NewRequest(
        request_id="owned", token_ids=[5, 6, 7], block_ids=[1, 2], num_scheduled_tokens=3
    )
    decode = pb.ContinuingRequest(request_id="owned", num_scheduled_tokens=1)
    old = PlanStream(channel)
    old_tokens = list(old.step(pb.StepPlan(step_id=1, new_requests=[prompt])).outputs[0].token_ids)
    # Plans still queued on the old stream when the new one opens must never run after it.
    for step in range(2, 12):
        old.send(pb.StepPlan(step_id=step, continuing_requests=[decode]))
    old_tokens += old.receive().outputs[0].token_ids

    new = PlanStream(channel)
    refused = new.step(pb.StepPlan(step_id=1, continuing_requests=[decode]))
    assert [(r.request_id, r.code) for r in refused.rejected] == [("owned", 3)]
    assert "unknown request id" in refused.rejected[0].message
    with pytest.raises(grpc.RpcError) as error:
        old.close()
    assert error.value.code() == grpc.StatusCode.ABORTED
    assert "superseded" in error.value.details()

    # The new scheduler rebuilds the request and gets the same greedy tokens: nothing of the
    # old stream touched it.
    tokens = list(new.step(pb.StepPlan(step_id=2, new_requests=[prompt])).outputs[0].token_ids)
    tokens += new.step(pb.StepPlan(step_id=3, continuing_requests=[decode])).outputs[0].token_ids
    assert tokens == old_tokens
    new.step(pb.StepPlan(step_id=4, dropped_request_ids=["owned"]))
    new.close()


def _threads_under_the_process_name(pid: int) -> int:
    """Threads that keep the process's own name: Python's and native pools' (OpenMP, OpenBLAS),
    not gRPC's, which name theirs."""
    tasks = Path(f"/proc/{pid}/task")
    name = (tasks / str(pid) / "comm").read_text()
    return sum((task / "comm").read_text() == name for task in tasks.iterdir())


@pytest.mark.skipif(not Path("/proc/self/task").is_dir(), reason="counts threads through /proc")
def test_a_served_executor_runs_one_team_of_openmp_threads(
    served: tuple[grpc.Channel, int], model_dir: Path
) -> None:
    # libgomp keeps a team per thread that starts parallel regions; a second team makes more
    # OpenMP threads than --threads asks for, and libgomp then all but stops busy-waiting
    # between regions, which slowed every decode step (executor_service.serving.server.step_thread).
    prompt = pb.NewRequest(
        request_id="team", token_ids=list(range(5, 37)), block_ids=[0, 1, 2, 3], num_scheduled_tokens=32
    )
    counts = {}
    one_thread_channel, one_thread_pid = served
    stream = PlanStream(one_thread_channel)
    assert stream.step(pb.StepPlan(step_id=1, new_requests=[prompt])).outputs[0].token_ids
    stream.close()
    counts[1] = _threads_under_the_process_name(one_thread_pid)
    with start_executor(model_dir, num_kv_blocks=NUM_BLOCKS, block_size=BLOCK_SIZE, threads=3) as (address, process):
        with token_channel(address) as channel:
            stream = PlanStream(channel)
            assert stream.step(pb.StepPlan(step_id=1, new_requests=[prompt])).outputs[0].token_ids
            stream.close()
        counts[3] = _threads_under_the_process_name(process.pid)
    # Four threads more than with one: the two workers of the step thread's OpenMP team and two
    # of torch's pthreadpool, which torch.set_num_threads sizes the same way. A second OpenMP
    # team would add two more.
    assert counts[3] - counts[1] == 4
