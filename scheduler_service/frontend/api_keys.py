"""Bearer tokens on the client port: every call but the health service's must carry
`authorization: Bearer KEY`, else it ends UNAUTHENTICATED before any handler runs (and before its
request is even parsed). Generation takes the keys of --api-key-file; Admin (drain, knobs,
audit) only those of --admin-key-file, so a client key cannot drain executors. With client keys
but no admin keys, Admin is closed (PERMISSION_DENIED); with no keys at all, both are open."""

from __future__ import annotations

import hmac
import logging
from collections.abc import Awaitable, Callable
from pathlib import Path

import grpc
from grpc_health.v1 import health

from protos.splitserve.v1 import admin_pb2
from scheduler_service.core.tenants import check_tenant_name

logger = logging.getLogger(__name__)

AUTHORIZATION_METADATA = "authorization"
BEARER_PREFIX = "Bearer "
# In a key file's tenant column: the key's calls say their tenant themselves (a gateway's key).
FORWARDER_TENANT = "*"
# Probes must not need credentials (Kubernetes' gRPC probe sends none).
OPEN_METHOD_PREFIXES = (f"/{health.SERVICE_NAME}/",)
ADMIN_METHOD_PREFIX = f"/{admin_pb2.DESCRIPTOR.services_by_name['Admin'].full_name}/"
ADMIN_CLOSED = (
    "the Admin service takes only admin keys, and this scheduler has none: start it with "
    "--admin-key-file"
)


class ApiKeyFileError(ValueError):
    """The key file cannot be used; the message says why."""


def load_api_keys(path: Path) -> tuple[bytes, ...]:
    """The keys in a file (see load_key_tenants for its format)."""
    return tuple(load_key_tenants(path))


def load_key_tenants(path: Path) -> dict[bytes, str]:
    """Each key of a key file with its tenant: one key per line, optionally followed by the name
    of the tenant its requests count for (core/tenants.py), or by `*` for a gateway's key whose
    calls name their tenant in x-splitserve-tenant; no name: the default tenant (an empty
    string here). Blank lines and lines starting with # are skipped. Several keys let one be
    rotated out while clients move to the next."""
    try:
        lines = path.read_text().splitlines()
    except (OSError, UnicodeDecodeError) as error:
        raise ApiKeyFileError(f"cannot read the API key file {str(path)!r}: {error}") from error
    tenants: dict[bytes, str] = {}
    for number, line in enumerate(lines, 1):
        fields = line.split()
        if not fields or fields[0].startswith("#"):
            continue
        if len(fields) > 2:
            raise ApiKeyFileError(f"the API key file {str(path)!r} line {number} has {len(fields)} fields: a key and at most a tenant name")
        tenant = fields[1] if len(fields) == 2 else ""
        if tenant not in ("", FORWARDER_TENANT):
            try:
                check_tenant_name(tenant)
            except ValueError as error:
                raise ApiKeyFileError(f"the API key file {str(path)!r} line {number}: {error}") from None
        tenants[fields[0].encode()] = tenant
    if not tenants:
        raise ApiKeyFileError(f"the API key file {str(path)!r} holds no key")
    short = [key for key in tenants if len(key) < 16]
    if short:
        raise ApiKeyFileError(f"the API key file {str(path)!r} has {len(short)} key(s) under 16 characters")
    return tenants


class ApiKeyInterceptor(grpc.aio.ServerInterceptor):
    """client_keys: what every call but Admin's needs (None: nothing). admin_keys: what Admin's
    calls need (None: closed when there are client keys, else open)."""

    def __init__(self, client_keys: tuple[bytes, ...] | None, admin_keys: tuple[bytes, ...] | None) -> None:
        self._client_keys = client_keys
        self._admin_keys = admin_keys

    async def intercept_service(
        self,
        continuation: Callable[[grpc.HandlerCallDetails], Awaitable[grpc.RpcMethodHandler]],
        details: grpc.HandlerCallDetails,
    ) -> grpc.RpcMethodHandler:
        handler = await continuation(details)
        if handler is None or details.method.startswith(OPEN_METHOD_PREFIXES):
            return handler
        admin = details.method.startswith(ADMIN_METHOD_PREFIX)
        keys = self._admin_keys if admin else self._client_keys
        if keys is None:
            if admin and self._client_keys is not None:
                logger.info("event=call_refused method=%r reason=%r", details.method, ADMIN_CLOSED)
                return refusing_handler(handler, grpc.StatusCode.PERMISSION_DENIED, ADMIN_CLOSED)
            return handler
        problem = _problem(dict(details.invocation_metadata or ()).get(AUTHORIZATION_METADATA), keys)
        if problem is None:
            return handler
        logger.info("event=call_unauthenticated method=%r reason=%r", details.method, problem)
        return refusing_handler(handler, grpc.StatusCode.UNAUTHENTICATED, problem)


def _problem(authorization: str | bytes | None, keys: tuple[bytes, ...]) -> str | None:
    if authorization is None:
        return "this server needs an API key: send metadata 'authorization: Bearer KEY'"
    text = authorization.decode(errors="replace") if isinstance(authorization, bytes) else authorization
    if not text.startswith(BEARER_PREFIX):
        return "the authorization metadata must be 'Bearer KEY'"
    presented = presented_key(text)
    # Every key compared in constant time, so timing tells nothing about any of them.
    matches = [hmac.compare_digest(presented, key) for key in keys]
    return None if any(matches) else "the API key is not valid"


def presented_key(authorization: str) -> bytes:
    """The key in an `authorization: Bearer KEY` value."""
    return authorization.removeprefix(BEARER_PREFIX).strip().encode()


def refusing_handler(
    handler: grpc.RpcMethodHandler, code: grpc.StatusCode, message: str
) -> grpc.RpcMethodHandler:
    """A handler of the same shape as `handler` that ends the call with code and message, its
    request left unparsed."""

    async def refuse(request: object, context: grpc.aio.ServicerContext) -> None:
        await context.abort(code, message)

    kind = ("stream" if handler.request_streaming else "unary") + "_" + (
        "stream" if handler.response_streaming else "unary"
    )
    return handler._replace(request_deserializer=None, **{kind: refuse})
