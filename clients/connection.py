"""How a client reaches the server: channel credentials and per-call metadata from the plain
arguments both clients take (an API key, a CA certificate), so each client opens its channel
the same way."""

from __future__ import annotations

from collections.abc import Sequence

import grpc

Metadata = Sequence[tuple[str, str]]


def channel_credentials(
    credentials: grpc.ChannelCredentials | None, root_certificates: bytes | None, tls: bool
) -> grpc.ChannelCredentials | None:
    """The credentials to open the channel with; None for plaintext."""
    if credentials is not None:
        if root_certificates is not None:
            raise ValueError("pass credentials or root_certificates, not both")
        return credentials
    if root_certificates is not None or tls:
        # None: the system's root certificates.
        return grpc.ssl_channel_credentials(root_certificates=root_certificates)
    return None


def call_metadata(metadata: Metadata | None, api_key: str | None) -> tuple[tuple[str, str], ...] | None:
    """Metadata sent with every call: the caller's, plus the API key as a bearer token."""
    pairs = tuple(metadata or ())
    if api_key is not None:
        if not api_key or api_key != api_key.strip() or "\n" in api_key:
            raise ValueError("api_key must be a non-empty token without surrounding whitespace")
        pairs += (("authorization", f"Bearer {api_key}"),)
    return pairs or None
