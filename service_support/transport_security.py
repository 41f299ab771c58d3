"""TLS for both services and their clients: PEM files read once at start (a wrong path stops the
start with a message), the gRPC credentials made from them, and the name a peer's verified certificate gives it.

Both ends of each link use these, so the scheduler, the executor and the client library agree
on what a flag pair means (a certificate needs its key; a client CA means mutual TLS).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

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
    """A server's certificate (chain) and key, and the CA its clients' certificates must chain
    to (mutual TLS) when set; PEM bytes, read from the flags' files at start."""

    cert_pem: bytes
    key_pem: bytes
    client_ca_pem: bytes | None = None

    @property
    def mutual(self) -> bool:
        return self.client_ca_pem is not None

    def credentials(self) -> grpc.ServerCredentials:
        pair = (self.key_pem, self.cert_pem)
        if self.client_ca_pem is None:
            return grpc.ssl_server_credentials([pair])
        return grpc.ssl_server_credentials(
            [pair], root_certificates=self.client_ca_pem, require_client_auth=True
        )


def server_tls(
    cert: Path | None, key: Path | None, client_ca: Path | None = None
) -> ServerTls | None:
    """ServerTls from the --tls-cert/--tls-key/--tls-client-ca flags, every file read now; None
    when all are unset."""
    if cert is None and key is None:
        if client_ca is not None:
            raise TlsConfigError("--tls-client-ca needs --tls-cert and --tls-key (mutual TLS is TLS)")
        return None
    if cert is None or key is None:
        raise TlsConfigError("--tls-cert and --tls-key go together")
    return ServerTls(
        read_pem(cert, "TLS certificate"),
        read_pem(key, "TLS key"),
        read_pem(client_ca, "client CA") if client_ca is not None else None,
    )


@dataclass(slots=True, frozen=True)
class ClientTls:
    """What a client trusts (root CA; None: the system's roots) and, for mutual TLS, the
    certificate and key it presents; PEM bytes."""

    ca_pem: bytes | None = None
    cert_pem: bytes | None = None
    key_pem: bytes | None = None
    # Name the server's certificate must carry, when it is not the host being dialled (an IP
    # found by DNS discovery, say).
    server_name: str | None = None

    def __post_init__(self) -> None:
        if (self.cert_pem is None) != (self.key_pem is None):
            raise TlsConfigError("a client certificate and its key go together")

    @property
    def mutual(self) -> bool:
        return self.cert_pem is not None

    def credentials(self) -> grpc.ChannelCredentials:
        return grpc.ssl_channel_credentials(
            root_certificates=self.ca_pem, private_key=self.key_pem, certificate_chain=self.cert_pem
        )

    def channel_options(self) -> list[tuple[str, str]]:
        return [("grpc.ssl_target_name_override", self.server_name)] if self.server_name else []


def client_tls(
    ca: Path | None, cert: Path | None = None, key: Path | None = None, server_name: str | None = None
) -> ClientTls:
    """ClientTls from files, every one read now."""
    return ClientTls(
        read_pem(ca, "CA certificate") if ca is not None else None,
        read_pem(cert, "client certificate") if cert is not None else None,
        read_pem(key, "client key") if key is not None else None,
        server_name,
    )


def aio_channel(address: str, options: Sequence[tuple[str, Any]], tls: ClientTls | None) -> grpc.aio.Channel:
    """An asyncio channel to address: TLS as tls says (its server-name override added to
    options), plaintext without it."""
    if tls is None:
        return grpc.aio.insecure_channel(address, options)
    return grpc.aio.secure_channel(address, tls.credentials(), [*options, *tls.channel_options()])


def allows_client_auth(cert_pem: bytes) -> bool | None:
    """Whether a certificate may act as a TLS client's: its ExtendedKeyUsage, when it has one,
    names clientAuth (or any purpose). BoringSSL refuses a client certificate without it at the
    handshake ("unsupported certificate purpose"). None when it cannot be told: the cryptography
    package (the optional '.[certs]' extra) is not installed, or the PEM does not parse."""
    try:
        from cryptography import x509
        from cryptography.x509.oid import ExtendedKeyUsageOID
    except ImportError:
        return None
    try:
        cert = x509.load_pem_x509_certificate(cert_pem)
        usages = cert.extensions.get_extension_for_class(x509.ExtendedKeyUsage).value
    except x509.ExtensionNotFound:
        # No ExtendedKeyUsage: any purpose.
        return True
    except ValueError:
        return None
    return bool({ExtendedKeyUsageOID.CLIENT_AUTH, ExtendedKeyUsageOID.ANY_EXTENDED_KEY_USAGE} & set(usages))


def peer_certificate_name(context: grpc.aio.ServicerContext) -> str | None:
    """The common name of the certificate the peer proved it holds (mutual TLS), else None."""
    names = context.auth_context().get("x509_common_name")
    return names[0].decode() if names else None
