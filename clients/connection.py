"""How a client reaches the server: channel credentials and per-call metadata from the plain
arguments both clients take (an API key, a CA certificate), so each client opens its channel
the same way."""

from __future__ import annotations

from collections.abc import Mapping, Sequence

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


class CallMetadata:
    """A client's metadata for each call: its own, or with another API key (one channel serving
    callers with keys of their own) and the caller's W3C trace context."""

    def __init__(self, metadata: Metadata | None, api_key: str | None) -> None:
        self._caller = tuple(metadata or ())
        self._default = call_metadata(metadata, api_key)

    def __call__(
        self, api_key: str | None = None, trace_context: Mapping[str, str] | None = None
    ) -> tuple[tuple[str, str], ...] | None:
        pairs = self._default if api_key is None else call_metadata(self._caller, api_key)
        if trace_context:
            pairs = (*(pairs or ()), *trace_context.items())
        return pairs
