"""TLS for both services and their clients: PEM files read once at start, the gRPC credentials
made from them, and the name a peer's verified certificate gives it.

Both ends of each link use these, so the scheduler, the executor and the client library agree
on what a flag pair means (a certificate needs its key; a client CA means mutual TLS).
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import grpc


class TlsConfigError(ValueError):
    """A TLS flag combination or file that cannot work; the message says which and why."""


def read_pem(path: Path, what: str) -> bytes:
    """The bytes of a PEM file, or TlsConfigError naming the flag's role when unreadable."""
    try:
        data = path.read_bytes()
    except OSError as error:
        raise TlsConfigError(f"cannot read the {what} {str(path)!r}: {error.strerror}") from error
    if b"-----BEGIN " not in data:
        raise TlsConfigError(f"the {what} {str(path)!r} is not PEM (no -----BEGIN line)")
    return data


@dataclass(slots=True, frozen=True)
class ServerTls:
    """A server's certificate and key, and the CA its clients' certificates must chain to
    (mutual TLS) when set."""

    cert: Path
    key: Path
    client_ca: Path | None = None

    def credentials(self) -> grpc.ServerCredentials:
        pair = (read_pem(self.key, "TLS key"), read_pem(self.cert, "TLS certificate"))
        if self.client_ca is None:
            return grpc.ssl_server_credentials([pair])
        return grpc.ssl_server_credentials(
            [pair],
            root_certificates=read_pem(self.client_ca, "client CA"),
            require_client_auth=True,
        )


def server_tls(
    cert: Path | None, key: Path | None, client_ca: Path | None = None
) -> ServerTls | None:
    """ServerTls from the --tls-cert/--tls-key/--tls-client-ca flags; None when all are unset."""
    if cert is None and key is None:
        if client_ca is not None:
            raise TlsConfigError("--tls-client-ca needs --tls-cert and --tls-key (mutual TLS is TLS)")
        return None
    if cert is None or key is None:
        raise TlsConfigError("--tls-cert and --tls-key go together")
    return ServerTls(cert, key, client_ca)


@dataclass(slots=True, frozen=True)
class ClientTls:
    """What a client trusts (root CA; None: the system's roots) and, for mutual TLS, the
    certificate and key it presents."""

    ca: Path | None = None
    cert: Path | None = None
    key: Path | None = None
    # Name the server's certificate must carry, when it is not the host being dialled (an IP
    # found by DNS discovery, say).
    server_name: str | None = None

    def __post_init__(self) -> None:
        if (self.cert is None) != (self.key is None):
            raise TlsConfigError("a client certificate and its key go together")

    def credentials(self) -> grpc.ChannelCredentials:
        return grpc.ssl_channel_credentials(
            root_certificates=read_pem(self.ca, "CA certificate") if self.ca else None,
            private_key=read_pem(self.key, "client key") if self.key else None,
            certificate_chain=read_pem(self.cert, "client certificate") if self.cert else None,
        )

    def channel_options(self) -> list[tuple[str, str]]:
        return [("grpc.ssl_target_name_override", self.server_name)] if self.server_name else []


def peer_certificate_name(context: grpc.aio.ServicerContext) -> str | None:
    """The common name of the certificate the peer proved it holds (mutual TLS), else None."""
    names = context.auth_context().get("x509_common_name")
    return names[0].decode() if names else None
