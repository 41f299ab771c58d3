"""TLS flags as an operator writes them: every file is read at start, and a wrong path, a file
that is not PEM or half a pair stops the start with a message naming the flag's role."""

from __future__ import annotations

from pathlib import Path

import pytest

from executor_service.__main__ import parse_args
from service_support.transport_security import TlsConfigError, client_tls, server_tls

PEM = b"-----BEGIN CERTIFICATE-----\nMIIB\n-----END CERTIFICATE-----\n"


@pytest.fixture
def files(tmp_path: Path) -> dict[str, Path]:
    paths = {name: tmp_path / f"{name}.pem" for name in ("cert", "key", "ca")}
    for path in paths.values():
        path.write_bytes(PEM)
    (tmp_path / "notes.txt").write_text("not a certificate")
    paths["text"] = tmp_path / "notes.txt"
    paths["missing"] = tmp_path / "missing.pem"
    return paths


def test_server_files_are_read_once_at_start(files: dict[str, Path]) -> None:
    tls = server_tls(files["cert"], files["key"], files["ca"])
    assert tls is not None and tls.mutual and tls.cert_pem == PEM
    # The files can go after start: the credentials come from what was read.
    for path in (files["cert"], files["key"], files["ca"]):
        path.unlink()
    assert tls.credentials() is not None
    assert server_tls(None, None) is None


@pytest.mark.parametrize(
    ("cert", "key", "ca", "message"),
    [
        ("missing", "key", None, "cannot read the TLS certificate"),
        ("cert", "text", None, "the TLS key"),
        ("cert", None, None, "--tls-cert and --tls-key go together"),
        (None, None, "ca", "--tls-client-ca needs --tls-cert and --tls-key"),
        ("cert", "key", "missing", "cannot read the client CA"),
    ],
)
def test_server_flag_mistakes_are_named(
    files: dict[str, Path], cert: str | None, key: str | None, ca: str | None, message: str
) -> None:
    with pytest.raises(TlsConfigError, match=message):
        server_tls(*(files[name] if name else None for name in (cert, key, ca)))


def test_client_files_and_their_mistakes(files: dict[str, Path]) -> None:
    tls = client_tls(files["ca"], files["cert"], files["key"], "executor")
    assert tls.mutual and tls.channel_options() == [("grpc.ssl_target_name_override", "executor")]
    assert not client_tls(files["ca"]).mutual
    with pytest.raises(TlsConfigError, match="a client certificate and its key go together"):
        client_tls(files["ca"], files["cert"])
    with pytest.raises(TlsConfigError, match="not PEM"):
        client_tls(files["text"])


def test_the_executor_refuses_to_start_on_a_wrong_path(
    files: dict[str, Path], capsys: pytest.CaptureFixture[str]
) -> None:
    argv = ["--model", "m", "--port", "0", "--tls-cert", str(files["missing"]), "--tls-key", str(files["key"])]
    with pytest.raises(SystemExit) as exit_:
        parse_args(argv)
    assert exit_.value.code == 2
    assert "cannot read the TLS certificate" in capsys.readouterr().err
