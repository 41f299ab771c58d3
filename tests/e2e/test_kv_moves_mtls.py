"""K/V moves between executors under mutual TLS as deployed, through real processes and
deploy/make_certs.py's certificates: executors that present executor-peer.pem to each other
move a drained executor's running requests with their K/V (nothing recomputed), and that
certificate fetches K/V but cannot drive an executor. Without it an executor presents its
server certificate, which allows serverAuth only: peers refuse it, every move falls back to
recompute, and outputs stay exact. Greedy outputs equal transformers' throughout."""

from __future__ import annotations

import asyncio
from collections.abc import Iterator
from contextlib import ExitStack
from pathlib import Path

import grpc
import pytest
import torch

from protos.splitserve.executor.v1 import executor_pb2, executor_pb2_grpc
from protos.splitserve.v1 import generation_pb2 as pb
from tests.helpers.executor_process import ExecutorProcess
from tests.helpers.greedy_reference import Reference
from tests.helpers.issued_certs import issue_certs
from tests.helpers.kv_moves_checks import (
    distinct_prompts,
    drain,
    executor_state,
    stream_with_fault,
    wait_all_up,
    wait_for,
)
from tests.helpers.metrics_scrape import Samples, scrape, total
from tests.helpers.model_factory import build_model
from tests.helpers.scheduler_process import SchedulerProcess
from tests.helpers.service_process import free_port

torch.set_num_threads(1)
BLOCK_SIZE = 16
PROMPT_TOKENS = 200
MAX_TOKENS = 48
NUM_STREAMS = 8
# The name the executors' certificate carries besides localhost and 127.0.0.1, and under which
# executors and the scheduler check it, as under Kubernetes where pods are dialled by IP.
EXECUTOR_NAME = "splitserve-executor"


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return build_model("llama", tmp_path_factory.mktemp("moves-mtls") / "llama", seed=23)


@pytest.fixture(scope="module")
def reference(model_dir: Path) -> Reference:
    return Reference(model_dir)


@pytest.fixture(scope="module")
def certs(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return issue_certs(tmp_path_factory.mktemp("certs"), "--executor-name", EXECUTOR_NAME)


def _executor_flags(certs: Path, peer_certificate: bool) -> dict[str, object]:
    """Mutual TLS alone, as the secured setups run executors; with the peer certificate or not."""
    flags: dict[str, object] = {
        "num_kv_blocks": 640,
        "block_size": BLOCK_SIZE,
        "tls_cert": certs / "executor.pem",
        "tls_key": certs / "executor-key.pem",
        "tls_client_ca": certs / "ca.pem",
        "executor_token_file": None,
    }
    if peer_certificate:
        flags |= {
            "tls_peer_cert": certs / "executor-peer.pem",
            "tls_peer_key": certs / "executor-peer-key.pem",
            "tls_peer_server_name": EXECUTOR_NAME,
        }
    return flags


def _scheduler(certs: Path, executors: list[str], metrics_port: int) -> SchedulerProcess:
    return SchedulerProcess(
        executors,
        max_num_batched_tokens=1024,
        metrics_port=metrics_port,
        executor_tls_ca=certs / "ca.pem",
        executor_tls_cert=certs / "scheduler-client.pem",
        executor_tls_key=certs / "scheduler-client-key.pem",
        executor_tls_server_name=EXECUTOR_NAME,
        executor_token_file=None,
    )


def _jobs(seed: int) -> list[tuple[list[int], int]]:
    return distinct_prompts(NUM_STREAMS, PROMPT_TOKENS, MAX_TOKENS, seed)


@pytest.fixture
def executors(model_dir: Path, certs: Path, request: pytest.FixtureRequest) -> Iterator[list[ExecutorProcess]]:
    with ExitStack() as stack:
        flags = _executor_flags(certs, peer_certificate=request.param)
        started = [ExecutorProcess(model_dir, port=free_port(), **flags) for _ in range(2)]
        for executor in started:
            stack.callback(executor.close)
        for executor in started:
            executor.wait_ready()
        yield started


def _drain_one(certs: Path, executors: list[ExecutorProcess], seed: int) -> tuple[list[tuple[list[int], int]], list[list[int]], Samples]:
    """8 greedy streams over both executors, the first drained mid-generation: the jobs, their
    outputs and the scheduler's metrics."""
    addresses = [executor.wait_ready() for executor in executors]
    metrics_port = free_port()
    scheduler = _scheduler(certs, addresses, metrics_port)
    try:
        address = scheduler.wait_ready(timeout_s=120.0)
        wait_all_up(address, 2)
        jobs = _jobs(seed)
        outputs = asyncio.run(stream_with_fault(address, jobs, lambda: drain(address, addresses[0])))
        wait_for(lambda: executor_state(address, addresses[0]) == pb.EXECUTOR_STATE_DRAINED, "drained")
        samples, _ = scrape(metrics_port)
    finally:
        scheduler.close()
    return jobs, outputs, samples


@pytest.mark.parametrize("executors", [True], indirect=True)
def test_a_drain_moves_kv_between_executors_under_mutual_tls(
    executors: list[ExecutorProcess], certs: Path, reference: Reference
) -> None:
    jobs, outputs, samples = _drain_one(certs, executors, seed=1)
    for (prompt, max_tokens), output in zip(jobs, outputs, strict=True):
        assert output == reference(prompt, max_tokens)
    assert samples["splitserve:kv_blocks_migrated_total"] > 0
    assert samples['splitserve:kv_moves_total{outcome="ok"}'] > 0
    assert total(samples, "splitserve:recomputed_tokens_total") == 0, samples
    for executor in executors:
        assert "event=executor_peer_tls_unusable" not in executor.log_text()


@pytest.mark.parametrize("executors", [False], indirect=True)
def test_without_the_peer_certificate_moves_fail_and_are_recomputed_exactly(
    executors: list[ExecutorProcess], certs: Path, reference: Reference
) -> None:
    """The server certificate presented as a client one is refused by the source ('unsupported
    certificate purpose'): no block moves, the requests are recomputed, outputs stay exact; each
    executor said so at start."""
    jobs, outputs, samples = _drain_one(certs, executors, seed=2)
    for (prompt, max_tokens), output in zip(jobs, outputs, strict=True):
        assert output == reference(prompt, max_tokens)
    assert samples.get("splitserve:kv_blocks_migrated_total", 0) == 0
    assert samples.get('splitserve:kv_moves_total{outcome="ok"}', 0) == 0
    assert samples['splitserve:kv_moves_total{outcome="failed"}'] > 0
    assert total(samples, "splitserve:recomputed_tokens_total") > 0, samples
    logs = [executor.log_text() for executor in executors]
    for log in logs:
        assert "event=executor_peer_tls_unusable" in log and "--tls-peer-cert" in log
    # The destination's fetches failed at the handshake, never reaching the source's servicer.
    assert any("event=kv_import_failed" in log and "UNAVAILABLE" in log for log in logs)
    assert not any("event=kv_fetch_refused" in log for log in logs)


def test_the_peer_certificate_fetches_kv_but_cannot_drive_an_executor(model_dir: Path, certs: Path) -> None:
    """executor-peer.pem is signed by the executors' client CA, so KvTransfer admits it (an
    unknown transfer id is then NOT_FOUND, past admission), but its name is no scheduler's:
    Describe and Execute refuse it."""
    executor = ExecutorProcess(model_dir, port=free_port(), **_executor_flags(certs, peer_certificate=True))
    try:
        address = executor.wait_ready()
        credentials = grpc.ssl_channel_credentials(
            (certs / "ca.pem").read_bytes(),
            (certs / "executor-peer-key.pem").read_bytes(),
            (certs / "executor-peer.pem").read_bytes(),
        )
        with grpc.secure_channel(address, credentials) as channel:
            stub = executor_pb2_grpc.ExecutorStub(channel)
            with pytest.raises(grpc.RpcError) as executed:
                next(stub.Execute(iter([executor_pb2.StepPlan(step_id=0)]), timeout=30))
            with pytest.raises(grpc.RpcError) as described:
                stub.Describe(executor_pb2.DescribeRequest(), timeout=30)
            fetch = executor_pb2_grpc.KvTransferStub(channel).FetchBlocks(
                executor_pb2.FetchBlocksRequest(transfer_id="no-such-transfer"), timeout=30
            )
            with pytest.raises(grpc.RpcError) as fetched:
                next(fetch)
    finally:
        executor.close()
    for refused in (executed.value, described.value):
        assert refused.code() == grpc.StatusCode.PERMISSION_DENIED
        assert "--allowed-scheduler-names" in refused.details()
    assert fetched.value.code() == grpc.StatusCode.NOT_FOUND
    assert "no open offer" in fetched.value.details()
