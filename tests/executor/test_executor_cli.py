"""The executor's command line, parsed without starting anything."""

from __future__ import annotations

from pathlib import Path

import pytest

from executor_service.__main__ import parse_args
from executor_service.serving.kv_fetch import peer_certificate_problem
from executor_service.serving.settings import parse_size
from service_support.default_ports import DEFAULT_EXECUTOR_PORT
from service_support.transport_security import allows_client_auth
from tests.helpers.executor_token import token_file
from tests.helpers.issued_certs import issue_certs

# An executor refuses to start without an access rule; these tests are about the other flags.
MODEL = ["--model", "/m", "--insecure-executor"]


@pytest.mark.parametrize(
    ("text", "size"),
    [("1048576", 1 << 20), ("512MiB", 512 << 20), ("2GiB", 2 << 30), ("1.5GB", 1_500_000_000)],
)
def test_parse_size(text: str, size: int) -> None:
    assert parse_size(text) == size


@pytest.mark.parametrize("text", ["", "lots", "5XB", "-1GiB"])
def test_parse_size_refuses_nonsense(text: str) -> None:
    with pytest.raises(ValueError):
        parse_size(text)


def test_flags_reach_the_settings() -> None:
    settings = parse_args(
        [*MODEL, "--port", "0", "--dtype", "bfloat16", "--kv-cache-memory", "64MiB"]
    )
    assert settings.model_dir == Path("/m")
    assert (settings.port, settings.dtype, settings.device) == (0, "bfloat16", "auto")
    assert (settings.kv_cache_bytes, settings.num_kv_blocks) == (64 << 20, None)
    assert (settings.trust_remote_code, settings.attention_backend) == (False, "auto")
    chosen = parse_args(
        [*MODEL, "--port", "0", "--trust-remote-code", "--attention-backend", "sdpa"]
    )
    assert (chosen.trust_remote_code, chosen.attention_backend) == (True, "sdpa")
    assert settings.packed_linear
    assert not parse_args([*MODEL, "--port", "0", "--no-packed-linear"]).packed_linear


def test_amx_which_changes_the_bits_by_host_is_opt_in_and_the_exact_greedy_screen_is_on() -> None:
    settings = parse_args([*MODEL])
    assert settings.greedy_screen and not settings.amx
    assert parse_args([*MODEL, "--amx"]).amx
    assert not parse_args([*MODEL, "--no-greedy-screen"]).greedy_screen


def test_weights_of_4_bit_blocks_are_read_as_blocks_unless_asked_not_to() -> None:
    assert parse_args([*MODEL]).weight_blocks
    assert not parse_args([*MODEL, "--no-weight-blocks"]).weight_blocks


def test_the_role_is_both_unless_chosen() -> None:
    assert parse_args([*MODEL]).role == "both"
    assert parse_args([*MODEL, "--role", "prefill"]).role == "prefill"
    assert parse_args([*MODEL, "--role", "decode"]).role == "decode"


def test_block_budget_flags_are_exclusive() -> None:
    with pytest.raises(SystemExit):
        parse_args(
            [*MODEL, "--port", "0", "--num-kv-blocks", "8", "--kv-cache-memory", "1GiB"]
        )


def test_the_port_has_a_default_the_scheduler_dials_by_default() -> None:
    assert parse_args([*MODEL]).port == DEFAULT_EXECUTOR_PORT == 50052
    assert not parse_args([*MODEL]).verbose
    assert parse_args([*MODEL, "-v"]).verbose


@pytest.mark.parametrize(
    ("flag", "value"),
    [
        ("--port", "-1"),
        ("--port", "65536"),
        ("--health-port", "70000"),
        ("--metrics-port", "-5"),
        ("--block-size", "0"),
        ("--num-kv-blocks", "0"),
        ("--kv-cache-memory", "0"),
        ("--kv-cache-memory", "lots"),
        ("--max-model-len", "0"),
        ("--max-logprobs", "-1"),
        ("--threads", "0"),
        ("--gpu-memory-utilization", "0"),
        ("--gpu-memory-utilization", "1.5"),
        ("--gpu-memory-utilization", "nan"),
        ("--lease-timeout", "0"),
        ("--lease-timeout", "-3"),
        ("--drain-timeout", "-1"),
        ("--tensor-parallel-size", "0"),
        ("--cuda-graph-max-batch", "-1"),
        ("--block-size", "sixteen"),
        ("--device", "gpu"),
        ("--role", "verify"),
    ],
)
def test_a_meaningless_value_is_argparses_error(
    flag: str, value: str, capsys: pytest.CaptureFixture[str]
) -> None:
    with pytest.raises(SystemExit) as exit_:
        parse_args([*MODEL, flag, value])
    assert exit_.value.code == 2
    assert f"error: argument {flag}: " in capsys.readouterr().err.splitlines()[-1]


@pytest.mark.parametrize(
    ("flag", "value"),
    [("--port", "0"), ("--max-logprobs", "0"), ("--drain-timeout", "0"), ("--gpu-memory-utilization", "1")],
)
def test_edge_values_that_mean_something_are_taken(flag: str, value: str) -> None:
    parse_args([*MODEL, flag, value])


@pytest.fixture(scope="module")
def certs(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """deploy/make_certs.py's set: server-only executor.pem, clientAuth-only executor-peer.pem."""
    return issue_certs(tmp_path_factory.mktemp("certs"))


def mutual(certs: Path) -> list[str]:
    return [
        "--model", "/m",
        "--tls-cert", str(certs / "executor.pem"),
        "--tls-key", str(certs / "executor-key.pem"),
        "--tls-client-ca", str(certs / "ca.pem"),
    ]  # fmt: skip


def test_the_peer_certificate_and_name_reach_the_settings(certs: Path) -> None:
    settings = parse_args([
        *mutual(certs),
        "--tls-peer-cert", str(certs / "executor-peer.pem"),
        "--tls-peer-key", str(certs / "executor-peer-key.pem"),
        "--tls-peer-server-name", "splitserve-executor",
    ])  # fmt: skip
    peer = settings.peer_tls
    assert peer is not None and peer.mutual
    assert peer.cert_pem == (certs / "executor-peer.pem").read_bytes()
    assert peer.key_pem == (certs / "executor-peer-key.pem").read_bytes()
    # Sources are checked against the CA that signs executors, dialled by IP under a name.
    assert peer.ca_pem == (certs / "ca.pem").read_bytes()
    assert peer.channel_options() == [("grpc.ssl_target_name_override", "splitserve-executor")]
    assert peer_certificate_problem(settings.tls, peer) is None


def test_without_a_peer_certificate_a_server_only_one_is_presented_and_named_a_problem(certs: Path) -> None:
    settings = parse_args(mutual(certs))
    assert settings.tls is not None and settings.peer_tls is not None
    assert settings.peer_tls.cert_pem == settings.tls.cert_pem
    problem = peer_certificate_problem(settings.tls, settings.peer_tls)
    assert problem is not None
    assert "does not allow clientAuth" in problem and "--tls-peer-cert" in problem and "recomputed" in problem
    # A server certificate that allows clientAuth too would do: only the purpose matters.
    assert allows_client_auth((certs / "scheduler-client.pem").read_bytes()) is True
    assert allows_client_auth((certs / "executor.pem").read_bytes()) is False
    # Plaintext and server-only TLS present no certificate: nothing to warn about.
    assert parse_args([*MODEL]).peer_tls is None
    server_only = parse_args(mutual(certs)[:6] + ["--executor-token-file", str(token_file())])
    assert server_only.peer_tls is not None and not server_only.peer_tls.mutual
    assert peer_certificate_problem(server_only.tls, server_only.peer_tls) is None


@pytest.mark.parametrize(
    ("flags", "reason"),
    [
        (["--tls-peer-cert", "executor-peer.pem"], "--tls-peer-cert and --tls-peer-key go together"),
        (["--tls-peer-key", "executor-peer-key.pem"], "--tls-peer-cert and --tls-peer-key go together"),
        (["--tls-peer-cert", "missing.pem", "--tls-peer-key", "executor-peer-key.pem"], "peer certificate"),
    ],
)
def test_peer_flags_that_cannot_work_are_refused(
    certs: Path, flags: list[str], reason: str, capsys: pytest.CaptureFixture[str]
) -> None:
    named = [str(certs / flag) if flag.endswith(".pem") else flag for flag in flags]
    with pytest.raises(SystemExit) as exit_:
        parse_args([*mutual(certs), *named])
    assert exit_.value.code == 2
    assert reason in capsys.readouterr().err.splitlines()[-1]


def test_peer_flags_need_the_tls_they_apply_to(certs: Path, capsys: pytest.CaptureFixture[str]) -> None:
    peer = ["--tls-peer-cert", str(certs / "executor-peer.pem"), "--tls-peer-key", str(certs / "executor-peer-key.pem")]
    for argv, reason in (
        ([*MODEL, *peer], "need mutual TLS"),
        ([*mutual(certs)[:6], "--executor-token-file", str(token_file()), *peer], "need mutual TLS"),
        ([*MODEL, "--tls-peer-server-name", "splitserve-executor"], "needs TLS"),
    ):
        with pytest.raises(SystemExit):
            parse_args(argv)
        assert reason in capsys.readouterr().err.splitlines()[-1], argv
