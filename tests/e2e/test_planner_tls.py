"""The Planner API over TLS (real processes): a planner given --tls-cert/--tls-key serves its
front-ends over TLS, so the planner token never crosses the network in the clear; a front-end
verifies it with --planner-tls-ca (and --planner-tls-server-name when it dials a name the
certificate lacks), and one without the CA, or a plaintext caller, gets nothing from it. With
--tls-client-ca the planner takes only front-ends presenting a client certificate that CA signed
(--planner-tls-cert/--planner-tls-key)."""

from __future__ import annotations

import re
from collections.abc import Iterator
from contextlib import ExitStack
from dataclasses import dataclass
from pathlib import Path

import grpc
import pytest
import torch
import trustme

from clients import Client
from clients.errors import SplitserveError
from protos.executor_access import write_token_file
from protos.splitserve.v1 import generation_pb2 as pb
from protos.splitserve.v1 import generation_pb2_grpc
from tests.helpers.executor_process import ExecutorProcess
from tests.helpers.greedy_reference import Reference
from tests.helpers.model_factory import build_model
from tests.helpers.service_process import ServiceProcess
from tests.helpers.sim_executor_process import start_sim_executor
from tests.helpers.tier_processes import frontend, planner, wait_for

torch.set_num_threads(1)
# A name the certificate carries that is not the address the front-ends dial.
PLANNER_NAME = "planner.splitserve.test"


@dataclass(slots=True, frozen=True)
class TlsPlanner:
    address: str
    ca: Path
    # Signed by a CA the planner's certificate does not chain to.
    other_ca: Path
    token: Path
    process: ServiceProcess


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return build_model("llama", tmp_path_factory.mktemp("planner-tls") / "llama", seed=13)


def write_leaf(issuer: trustme.CA, host: str, common_name: str, folder: Path, stem: str) -> None:
    """A certificate issuer signs for host, as folder/{stem}.pem with its key in {stem}-key.pem."""
    issued = issuer.issue_cert(host, common_name=common_name)
    issued.cert_chain_pems[0].write_to_path(str(folder / f"{stem}.pem"))
    issued.private_key_pem.write_to_path(str(folder / f"{stem}-key.pem"))


@pytest.fixture(scope="module")
def tls_planner(tmp_path_factory: pytest.TempPathFactory, model_dir: Path) -> Iterator[TlsPlanner]:
    folder = tmp_path_factory.mktemp("planner-pki")
    ca, other = trustme.CA(), trustme.CA()
    ca.cert_pem.write_to_path(str(folder / "ca.pem"))
    other.cert_pem.write_to_path(str(folder / "other-ca.pem"))
    write_leaf(ca, PLANNER_NAME, "splitserve-planner", folder, "planner")
    token = folder / "planner-token"
    write_token_file(token)
    with ExitStack() as stack:
        executor = ExecutorProcess(model_dir, num_kv_blocks=64, max_model_len=256)
        stack.callback(executor.close)
        served = planner(
            [executor.wait_ready()], token,
            "--tls-cert", str(folder / "planner.pem"), "--tls-key", str(folder / "planner-key.pem"),
        )  # fmt: skip
        stack.callback(served.close)
        address = served.wait_ready()
        wait_for(lambda: "state=up" in served.log_text(), what="the planner holding its executor")
        yield TlsPlanner(address, folder / "ca.pem", folder / "other-ca.pem", token, served)


def test_a_front_end_that_verifies_the_planner_serves_as_transformers_does(
    tls_planner: TlsPlanner, model_dir: Path
) -> None:
    front = frontend(
        [tls_planner.address], tls_planner.token,
        "--planner-tls-ca", str(tls_planner.ca), "--planner-tls-server-name", PLANNER_NAME,
    )  # fmt: skip
    try:
        with Client(front.wait_ready(timeout_s=120.0)) as client:
            prompt = [5, 17, 42, 99, 7]
            result = client.generate(prompt_token_ids=prompt, max_tokens=12, temperature=0, ignore_eos=True)
        assert result.token_ids == Reference(model_dir)(prompt, 12)
        assert "planner_tls=on" in front.log_text()
        assert "tls=on" in tls_planner.process.log_text()
        # Served over TLS, the planner has no advice to give about its token.
        assert "planner_token_in_clear" not in tls_planner.process.log_text()
    finally:
        front.close()


@pytest.mark.parametrize("dialled_with", ["plaintext", "another-ca"])
def test_a_front_end_that_cannot_verify_the_planner_is_never_served(tls_planner: TlsPlanner, dialled_with: str) -> None:
    tls = (
        ["--planner-tls-ca", str(tls_planner.other_ca), "--planner-tls-server-name", PLANNER_NAME]
        if dialled_with == "another-ca"
        else []
    )
    connected_before = tls_planner.process.log_text().count("event=frontend_connected")
    front = frontend([tls_planner.address], tls_planner.token, "--no-executor-timeout", "2", *tls)
    try:
        address = wait_for_listening(front)
        with Client(address) as client, pytest.raises(SplitserveError) as refused:
            client.generate(prompt_token_ids=[5, 17, 42], max_tokens=4)
        assert refused.value.code is grpc.StatusCode.UNAVAILABLE
        assert "planner" in str(refused.value)
        # The planner saw no Connect stream from it: its token never reached the planner.
        assert tls_planner.process.log_text().count("event=frontend_connected") == connected_before
    finally:
        front.close()


def test_a_plaintext_caller_cannot_reach_the_planner_api(tls_planner: TlsPlanner) -> None:
    with grpc.insecure_channel(tls_planner.address) as channel:
        stub = generation_pb2_grpc.GenerationStub(channel)
        with pytest.raises(grpc.RpcError) as refused:
            stub.GetServerStatus(pb.GetServerStatusRequest(), timeout=5)
    assert refused.value.code() is grpc.StatusCode.UNAVAILABLE


def wait_for_listening(front: ServiceProcess) -> str:
    """The front-end's client address once it listens (it is never ready: no planner is up)."""
    wait_for(lambda: "event=frontend_listening" in front.log_text(), timeout_s=120.0, what="the front-end listening")
    found = re.search(r"event=frontend_listening address=(\S+):(\d+)", front.log_text())
    assert found is not None
    return f"{found.group(1)}:{found.group(2)}"


@pytest.mark.parametrize(("host", "warned"), [("0.0.0.0", True), ("127.0.0.1", False)])
def test_a_plaintext_planner_beyond_loopback_says_its_token_travels_in_the_clear(
    tls_planner: TlsPlanner, host: str, warned: bool
) -> None:
    # No executor answers at that address; the warning, if any, comes before the planner tries it.
    served = planner(["127.0.0.1:1"], tls_planner.token, "--host", host)
    try:
        served.wait_ready()
        wait_for(lambda: "event=executor_added" in served.log_text(), what="the planner trying its executor")
        assert ("event=planner_token_in_clear" in served.log_text()) is warned
    finally:
        served.close()


@dataclass(slots=True, frozen=True)
class MutualPlanner:
    address: str
    folder: Path
    token: Path
    process: ServiceProcess


@pytest.fixture(scope="module")
def mutual_planner(tmp_path_factory: pytest.TempPathFactory) -> Iterator[MutualPlanner]:
    """A planner serving the Planner API over mutual TLS (--tls-client-ca), over a simulated
    executor; in its folder, client certificates for front-ends from its CA (frontend.pem) and
    from another (stranger.pem)."""
    folder = tmp_path_factory.mktemp("planner-mtls")
    ca, other = trustme.CA(), trustme.CA()
    ca.cert_pem.write_to_path(str(folder / "ca.pem"))
    write_leaf(ca, PLANNER_NAME, "splitserve-planner", folder, "planner")
    for name, issuer in (("frontend", ca), ("stranger", other)):
        write_leaf(issuer, f"{name}.splitserve.test", f"splitserve-{name}", folder, name)
    token = folder / "planner-token"
    write_token_file(token)
    with ExitStack() as stack:
        executor = stack.enter_context(start_sim_executor(step_ms=5))
        served = planner(
            [executor], token,
            "--tls-cert", str(folder / "planner.pem"), "--tls-key", str(folder / "planner-key.pem"),
            "--tls-client-ca", str(folder / "ca.pem"),
        )  # fmt: skip
        stack.callback(served.close)
        address = served.wait_ready()
        wait_for(lambda: "state=up" in served.log_text(), what="the planner holding its executor")
        yield MutualPlanner(address, folder, token, served)


def mutual_frontend(planner_: MutualPlanner, client_certificate: str | None, *flags: str) -> ServiceProcess:
    certificate = (
        ["--planner-tls-cert", str(planner_.folder / f"{client_certificate}.pem"),
         "--planner-tls-key", str(planner_.folder / f"{client_certificate}-key.pem")]
        if client_certificate else []
    )  # fmt: skip
    return frontend(
        [planner_.address], planner_.token,
        "--planner-tls-ca", str(planner_.folder / "ca.pem"), "--planner-tls-server-name", PLANNER_NAME,
        *certificate, *flags,
    )  # fmt: skip


def test_a_front_end_presenting_the_cas_client_certificate_is_served_over_mutual_tls(
    mutual_planner: MutualPlanner,
) -> None:
    front = mutual_frontend(mutual_planner, "frontend")
    try:
        with Client(front.wait_ready(timeout_s=120.0)) as client:
            result = client.generate(prompt_token_ids=[5, 17, 42], max_tokens=4, ignore_eos=True)
        assert len(result.token_ids) == 4
        assert "planner_tls=mutual" in front.log_text()
        log = mutual_planner.process.log_text()
        assert "tls=mutual" in log
        # The planner names each front-end by the certificate it proved it holds.
        assert "certificate=splitserve-frontend" in log
    finally:
        front.close()


@pytest.mark.parametrize("client_certificate", [None, "stranger"])
def test_a_front_end_without_the_cas_client_certificate_is_never_served(
    mutual_planner: MutualPlanner, client_certificate: str | None
) -> None:
    connected_before = mutual_planner.process.log_text().count("event=frontend_connected")
    front = mutual_frontend(mutual_planner, client_certificate, "--no-executor-timeout", "2")
    try:
        with Client(wait_for_listening(front)) as client, pytest.raises(SplitserveError) as refused:
            client.generate(prompt_token_ids=[5, 17, 42], max_tokens=4)
        assert refused.value.code is grpc.StatusCode.UNAVAILABLE
        # The handshake failed: no Connect stream, so its token never reached the planner.
        assert mutual_planner.process.log_text().count("event=frontend_connected") == connected_before
    finally:
        front.close()
