"""Transport security against real processes: an executor that takes plans only from a scheduler
whose certificate its CA signed with an allowed name (the certificate's name is the scheduler's
identity), and a client API behind TLS and bearer tokens, Admin behind keys of its own, whose
health service stays open for probes."""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import grpc
import pytest
import torch
import trustme
from grpc_health.v1 import health_pb2, health_pb2_grpc

from clients import Client
from clients.errors import SplitserveError
from protos.splitserve.executor.v1 import executor_pb2, executor_pb2_grpc
from protos.splitserve.v1 import admin_pb2, admin_pb2_grpc, generation_pb2, generation_pb2_grpc
from tests.helpers.executor_process import ExecutorProcess
from tests.helpers.greedy_reference import Reference
from tests.helpers.model_factory import build_model
from tests.helpers.scheduler_process import SchedulerProcess
from tests.helpers.service_process import free_port

torch.set_num_threads(1)

API_KEY = "k3y-for-the-tests-0123456789"
ADMIN_KEY = "adm1n-key-for-the-tests-0123456789"
SCHEDULER_NAME = "scheduler-a"
# Allowed to hold the executor beside scheduler-a; "scheduler-c" is signed by the same CA but not.
OTHER_ALLOWED_NAME = "scheduler-b"


@dataclass(slots=True, frozen=True)
class Pki:
    folder: Path
    ca: Path
    server_cert: Path
    server_key: Path
    client_cert: Path
    client_key: Path
    # Signed by the trusted CA, for another scheduler.
    other_client_cert: Path
    other_client_key: Path
    # Signed by the trusted CA, with a name the executor does not allow.
    stranger_client_cert: Path
    stranger_client_key: Path
    # Signed by a CA nobody trusts.
    rogue_client_cert: Path
    rogue_client_key: Path
    api_keys: Path
    admin_keys: Path


def issue(ca: trustme.CA, folder: Path, name: str, *identities: str) -> tuple[Path, Path]:
    cert = ca.issue_cert(*identities, common_name=name)
    cert_path, key_path = folder / f"{name}.pem", folder / f"{name}-key.pem"
    cert.cert_chain_pems[0].write_to_path(str(cert_path))
    cert.private_key_pem.write_to_path(str(key_path))
    return cert_path, key_path


@pytest.fixture(scope="module")
def pki(tmp_path_factory: pytest.TempPathFactory) -> Pki:
    folder = tmp_path_factory.mktemp("pki")
    ca, rogue = trustme.CA(), trustme.CA()
    ca.cert_pem.write_to_path(str(folder / "ca.pem"))
    server = issue(ca, folder, "server", "localhost", "127.0.0.1")
    client = issue(ca, folder, SCHEDULER_NAME, "scheduler-a.test")
    other = issue(ca, folder, OTHER_ALLOWED_NAME, "scheduler-b.test")
    stranger = issue(ca, folder, "scheduler-c", "scheduler-c.test")
    rogue_client = issue(rogue, folder, "rogue", "rogue.test")
    keys = folder / "api-keys"
    keys.write_text(f"# rotated in 2026-11\n{API_KEY}\n\nanother-key-9876543210\n")
    admin_keys = folder / "admin-keys"
    admin_keys.write_text(f"{ADMIN_KEY}\n")
    return Pki(folder, folder / "ca.pem", *server, *client, *other, *stranger, *rogue_client, keys, admin_keys)


@dataclass(slots=True, frozen=True)
class Secured:
    executor: str
    executor_health: int
    scheduler: str
    scheduler_health: int
    executor_process: ExecutorProcess


@pytest.fixture(scope="module")
def secured(tmp_path_factory: pytest.TempPathFactory, pki: Pki) -> Iterator[Secured]:
    model_dir = build_model("llama", tmp_path_factory.mktemp("secure") / "llama", seed=5)
    executor_health, scheduler_health = free_port(), free_port()
    executor = ExecutorProcess(
        model_dir,
        num_kv_blocks=64,
        max_model_len=256,
        tls_cert=pki.server_cert,
        tls_key=pki.server_key,
        tls_client_ca=pki.ca,
        allowed_scheduler_names=f"{SCHEDULER_NAME},{OTHER_ALLOWED_NAME}",
        # Mutual TLS alone, as make_certs sets executors up.
        executor_token_file=None,
        health_port=executor_health,
    )
    try:
        executor_address = executor.wait_ready().replace("127.0.0.1", "localhost")
        scheduler = SchedulerProcess(
            executor_address,
            # The metadata claims another name: the certificate's must win.
            scheduler_id="claimed-in-metadata",
            executor_tls_ca=pki.ca,
            executor_tls_cert=pki.client_cert,
            executor_tls_key=pki.client_key,
            tls_cert=pki.server_cert,
            tls_key=pki.server_key,
            api_key_file=pki.api_keys,
            admin_key_file=pki.admin_keys,
            executor_token_file=None,
            health_port=scheduler_health,
        )
        try:
            address = scheduler.wait_ready(timeout_s=120.0).replace("127.0.0.1", "localhost")
            yield Secured(executor_address, executor_health, address, scheduler_health, executor)
        finally:
            scheduler.close()
    finally:
        executor.close()


def health(channel: grpc.Channel) -> int:
    return health_pb2_grpc.HealthStub(channel).Check(health_pb2.HealthCheckRequest(), timeout=10).status


def test_with_the_key_over_tls_a_request_is_served_as_by_transformers(
    secured: Secured, pki: Pki, tmp_path_factory: pytest.TempPathFactory
) -> None:
    reference = Reference(build_model("llama", tmp_path_factory.mktemp("reference") / "llama", seed=5))
    prompt = [5, 17, 40, 2, 99]
    with Client(secured.scheduler, api_key=API_KEY, root_certificates=pki.ca.read_bytes()) as client:
        result = client.generate(prompt_token_ids=prompt, max_tokens=12, temperature=0, ignore_eos=True)
        assert client.model_info().max_model_len == 256
    assert result.token_ids == reference(prompt, 12)


def test_one_client_can_call_with_each_callers_key(secured: Secured, pki: Pki) -> None:
    """A client without a key of its own (a gateway serving many callers) passes each call's:
    those calls are served, the rest refused; health needs none."""
    with Client(secured.scheduler, root_certificates=pki.ca.read_bytes()) as client:
        assert client.serving(timeout=10)
        result = client.generate(prompt_token_ids=[5, 6], max_tokens=2, api_key=API_KEY)
        assert len(result.token_ids) == 2
        assert client.model_info(api_key=API_KEY).max_model_len == 256
        with pytest.raises(SplitserveError) as refused:
            client.server_status()
        assert refused.value.code == grpc.StatusCode.UNAUTHENTICATED


@pytest.mark.parametrize(
    ("api_key", "message"),
    [(None, "needs an API key"), ("wrong-key-0123456789abc", "not valid")],
)
def test_without_a_valid_key_every_call_is_unauthenticated(
    secured: Secured, pki: Pki, api_key: str | None, message: str
) -> None:
    with Client(secured.scheduler, api_key=api_key, root_certificates=pki.ca.read_bytes()) as client:
        for call in (
            lambda: client.generate(prompt_token_ids=[5, 6], max_tokens=2),
            client.model_info,
            client.server_status,
            lambda: client.abort("some-id"),
        ):
            with pytest.raises(SplitserveError) as error:
                call()
            assert error.value.code == grpc.StatusCode.UNAUTHENTICATED
            assert message in error.value.details


def test_a_plaintext_client_cannot_talk_to_the_tls_port(secured: Secured) -> None:
    with Client(secured.scheduler, api_key=API_KEY, timeout=10) as client, pytest.raises(SplitserveError) as error:
        client.model_info()
    assert error.value.code == grpc.StatusCode.UNAVAILABLE


def test_health_stays_open_without_credentials(secured: Secured, pki: Pki) -> None:
    serving = health_pb2.HealthCheckResponse.SERVING
    credentials = grpc.ssl_channel_credentials(root_certificates=pki.ca.read_bytes())
    with grpc.secure_channel(secured.scheduler, credentials) as channel:
        assert health(channel) == serving
    for port in (secured.scheduler_health, secured.executor_health):
        with grpc.insecure_channel(f"127.0.0.1:{port}") as channel:
            assert health(channel) == serving


def execute_once(channel: grpc.Channel) -> executor_pb2.StepResult:
    """Opens Execute and sends an empty plan, as a scheduler's handshake does."""
    stub = executor_pb2_grpc.ExecutorStub(channel)
    responses = stub.Execute(iter([executor_pb2.StepPlan(step_id=0)]), timeout=10)
    return next(responses)


def client_credentials(pki: Pki, cert: Path | None, key: Path | None) -> grpc.ChannelCredentials:
    return grpc.ssl_channel_credentials(
        root_certificates=pki.ca.read_bytes(),
        private_key=key.read_bytes() if key else None,
        certificate_chain=cert.read_bytes() if cert else None,
    )


def test_an_executor_takes_plans_only_from_a_scheduler_its_ca_signed(secured: Secured, pki: Pki) -> None:
    with grpc.insecure_channel(secured.executor) as channel, pytest.raises(grpc.RpcError) as plain:
        execute_once(channel)
    assert plain.value.code() == grpc.StatusCode.UNAVAILABLE
    for cert, key in ((None, None), (pki.rogue_client_cert, pki.rogue_client_key)):
        with grpc.secure_channel(secured.executor, client_credentials(pki, cert, key)) as channel:
            with pytest.raises(grpc.RpcError) as refused:
                execute_once(channel)
            assert refused.value.code() == grpc.StatusCode.UNAVAILABLE
            with pytest.raises(grpc.RpcError) as described:
                executor_pb2_grpc.ExecutorStub(channel).Describe(executor_pb2.DescribeRequest(), timeout=10)
            assert described.value.code() == grpc.StatusCode.UNAVAILABLE


def test_the_scheduler_identity_is_its_certificate_name(secured: Secured, pki: Pki) -> None:
    credentials = client_credentials(pki, pki.other_client_cert, pki.other_client_key)
    with grpc.secure_channel(secured.executor, credentials) as channel, pytest.raises(grpc.RpcError) as refused:
        # Even claiming the holder's metadata identity does not get past its certificate name.
        stub = executor_pb2_grpc.ExecutorStub(channel)
        responses = stub.Execute(
            iter([executor_pb2.StepPlan(step_id=0)]),
            timeout=10,
            metadata=(("x-splitserve-scheduler-id", "claimed-in-metadata"),),
        )
        next(responses)
    assert refused.value.code() == grpc.StatusCode.FAILED_PRECONDITION
    # Someone holds it; who is in the executor's log, never in the answer.
    assert "held by another scheduler" in refused.value.details()
    assert SCHEDULER_NAME not in refused.value.details()
    # The certificate's name, then the scheduler's claim: the claim alone held nothing above.
    assert f"active_holder={SCHEDULER_NAME + '/claimed-in-metadata'!r}" in secured.executor_process.log_text()


def test_the_same_certificate_under_another_id_waits_instead_of_taking_over(secured: Secured, pki: Pki) -> None:
    """Two planner replicas share one client certificate: the second is refused while the first
    holds the executor, rather than superseding its stream."""
    credentials = client_credentials(pki, pki.client_cert, pki.client_key)
    with grpc.secure_channel(secured.executor, credentials) as channel, pytest.raises(grpc.RpcError) as refused:
        responses = executor_pb2_grpc.ExecutorStub(channel).Execute(
            iter([executor_pb2.StepPlan(step_id=0)]),
            timeout=10,
            metadata=(("x-splitserve-scheduler-id", "planner-replica-2"),),
        )
        next(responses)
    assert refused.value.code() == grpc.StatusCode.FAILED_PRECONDITION
    # The holder's stream was not superseded: it still serves.
    with Client(secured.scheduler, api_key=API_KEY, root_certificates=pki.ca.read_bytes()) as client:
        assert len(client.generate(prompt_token_ids=[5, 6], max_tokens=2).token_ids) == 2


def test_a_certificate_the_ca_signed_for_another_name_cannot_hold_the_executor(secured: Secured, pki: Pki) -> None:
    credentials = client_credentials(pki, pki.stranger_client_cert, pki.stranger_client_key)
    with grpc.secure_channel(secured.executor, credentials) as channel:
        stub = executor_pb2_grpc.ExecutorStub(channel)
        with pytest.raises(grpc.RpcError) as described:
            stub.Describe(executor_pb2.DescribeRequest(), timeout=10)
        with pytest.raises(grpc.RpcError) as executed:
            next(stub.Execute(iter([executor_pb2.StepPlan(step_id=0)]), timeout=10))
    for refused in (described.value, executed.value):
        assert refused.code() == grpc.StatusCode.PERMISSION_DENIED
        assert "--allowed-scheduler-names" in refused.details() and "scheduler-a" not in refused.details()


def test_admin_takes_only_admin_keys(secured: Secured, pki: Pki) -> None:
    credentials = grpc.ssl_channel_credentials(root_certificates=pki.ca.read_bytes())
    with grpc.secure_channel(secured.scheduler, credentials) as channel:
        admin = admin_pb2_grpc.AdminStub(channel)
        generation = generation_pb2_grpc.GenerationStub(channel)

        def bearer(key: str) -> tuple[tuple[str, str], ...]:
            return (("authorization", f"Bearer {key}"),)

        config = admin.GetSchedulingConfig(admin_pb2.GetSchedulingConfigRequest(), metadata=bearer(ADMIN_KEY), timeout=10)
        assert config.max_num_seqs > 0
        # A client key drains nothing; an admin key generates nothing.
        for call, key in (
            (lambda m: admin.GetSchedulingConfig(admin_pb2.GetSchedulingConfigRequest(), metadata=m, timeout=10), API_KEY),
            (lambda m: admin.DrainExecutor(admin_pb2.DrainExecutorRequest(address=secured.executor), metadata=m, timeout=10), API_KEY),
            (lambda m: generation.GetModelInfo(generation_pb2.GetModelInfoRequest(), metadata=m, timeout=10), ADMIN_KEY),
        ):
            with pytest.raises(grpc.RpcError) as refused:
                call(bearer(key))
            assert refused.value.code() == grpc.StatusCode.UNAUTHENTICATED


def test_with_client_keys_but_no_admin_keys_admin_is_closed(pki: Pki) -> None:
    scheduler = SchedulerProcess("127.0.0.1:1", wait_for="listening", api_key_file=pki.api_keys)
    try:
        with grpc.insecure_channel(scheduler.wait_ready(timeout_s=60.0)) as channel:
            with pytest.raises(grpc.RpcError) as refused:
                admin_pb2_grpc.AdminStub(channel).GetSchedulingConfig(
                    admin_pb2.GetSchedulingConfigRequest(),
                    metadata=(("authorization", f"Bearer {API_KEY}"),),
                    timeout=10,
                )
    finally:
        scheduler.close()
    assert refused.value.code() == grpc.StatusCode.PERMISSION_DENIED
    assert "--admin-key-file" in refused.value.details()
