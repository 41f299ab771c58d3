"""How a client reaches the server: the channel, its stubs, and each call's deadline and
metadata, from the plain arguments both clients take (an API key, a CA certificate), so the
blocking and the asyncio client open and use their channels the same way."""

from __future__ import annotations

import re
from collections.abc import Callable, Mapping, Sequence
from types import ModuleType
from typing import Any, ClassVar

import grpc
from grpc_health.v1 import health_pb2_grpc

from clients.calls import GenerateCall, UnaryCall
from protos.splitserve.v1 import generation_pb2_grpc as pb_grpc

Metadata = Sequence[tuple[str, str]]
# Whose request a call is, on a scheduler without API keys or for a key marked `*` in its key
# file (a gateway's); a key of a tenant of its own is never overridden by it.
TENANT_METADATA = "x-splitserve-tenant"
TENANT_TOKEN = re.compile(r"[!-~]+")


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


def call_metadata(
    metadata: Metadata | None, api_key: str | None, tenant: str | None = None
) -> tuple[tuple[str, str], ...] | None:
    """Metadata sent with every call: the caller's, plus the API key as a bearer token and the
    tenant the call is for."""
    pairs = tuple(metadata or ())
    if api_key is not None:
        if not api_key or api_key != api_key.strip() or "\n" in api_key:
            raise ValueError("api_key must be a non-empty token without surrounding whitespace")
        pairs += (("authorization", f"Bearer {api_key}"),)
    if tenant is not None:
        # What metadata can carry; which names are tenants' is the scheduler's to say.
        if TENANT_TOKEN.fullmatch(tenant) is None:
            raise ValueError(f"tenant must be a name of printable ASCII without spaces, got {tenant[:80]!r}")
        pairs += ((TENANT_METADATA, tenant),)
    return pairs or None


class CallMetadata:
    """A client's metadata for each call: its own, or with another API key or tenant (one
    channel serving callers of their own) and the caller's W3C trace context."""

    def __init__(self, metadata: Metadata | None, api_key: str | None, tenant: str | None) -> None:
        self._caller = tuple(metadata or ())
        self._api_key = api_key
        self._tenant = tenant
        self._default = call_metadata(metadata, api_key, tenant)

    def __call__(
        self,
        api_key: str | None = None,
        trace_context: Mapping[str, str] | None = None,
        tenant: str | None = None,
    ) -> tuple[tuple[str, str], ...] | None:
        pairs = self._default
        if api_key is not None or tenant is not None:
            pairs = call_metadata(
                self._caller,
                self._api_key if api_key is None else api_key,
                self._tenant if tenant is None else tenant,
            )
        if trace_context:
            pairs = (*(pairs or ()), *trace_context.items())
        return pairs


class Channel:
    """A client's channel and stubs; transport is grpc (the blocking client) or grpc.aio."""

    def __init__(
        self,
        transport: ModuleType,
        address: str,
        timeout: float | None,
        api_key: str | None,
        root_certificates: bytes | None,
        tls: bool,
        credentials: grpc.ChannelCredentials | None,
        metadata: Metadata | None,
        tenant: str | None,
    ) -> None:
        self._timeout = timeout
        self._metadata = CallMetadata(metadata, api_key, tenant)
        credentials = channel_credentials(credentials, root_certificates, tls)
        if credentials is None:
            self.channel = transport.insecure_channel(address)
        else:
            self.channel = transport.secure_channel(address, credentials)
        self.generation = pb_grpc.GenerationStub(self.channel)
        self._health = health_pb2_grpc.HealthStub(self.channel)

    def stream_options(
        self, api_key: str | None, trace_context: Mapping[str, str] | None, tenant: str | None
    ) -> dict[str, Any]:
        """Deadline and metadata of a Generate stream."""
        return {"timeout": self._timeout, "metadata": self._metadata(api_key, trace_context, tenant)}

    def unary(self, call: UnaryCall[Any]) -> tuple[Callable[..., Any], dict[str, Any]]:
        """The stub method that sends `call`, and its deadline and metadata (none for health,
        which needs no API key)."""
        timeout = self._timeout if call.timeout is None else call.timeout
        if call.health:
            return getattr(self._health, call.method), {"timeout": timeout}
        return getattr(self.generation, call.method), {"timeout": timeout, "metadata": self._metadata(call.api_key)}


class ChannelClient:
    """What the blocking and the asyncio client share: their arguments (clients.Client documents
    them) and how a Generate stream opens. Each names its transport (grpc or grpc.aio) and its
    kind of delta stream, and runs unary calls its own way (_run)."""

    _transport: ClassVar[ModuleType]
    _stream_type: ClassVar[Callable[[Any], Any]]

    def __init__(
        self,
        address: str,
        *,
        timeout: float | None = None,
        api_key: str | None = None,
        root_certificates: bytes | None = None,
        tls: bool = False,
        credentials: grpc.ChannelCredentials | None = None,
        metadata: Metadata | None = None,
        tenant: str | None = None,
    ) -> None:
        self._channel = Channel(
            self._transport, address, timeout, api_key, root_certificates, tls, credentials, metadata, tenant
        )

    def _open(self, call: GenerateCall) -> Any:
        options = self._channel.stream_options(call.api_key, call.trace_context, call.tenant)
        return self._stream_type(self._channel.generation.Generate(call.request, **options))
