"""Bearer tokens on the client API: every call but the health service's must carry
`authorization: Bearer KEY` with a KEY from --api-key-file, else it ends UNAUTHENTICATED before
any handler runs (and before its request is even parsed)."""

from __future__ import annotations

import hmac
import logging
from collections.abc import Awaitable, Callable
from pathlib import Path

import grpc
from grpc_health.v1 import health

logger = logging.getLogger(__name__)

AUTHORIZATION_METADATA = "authorization"
BEARER_PREFIX = "Bearer "
# Probes must not need credentials (Kubernetes' gRPC probe sends none).
OPEN_METHOD_PREFIXES = (f"/{health.SERVICE_NAME}/",)


class ApiKeyFileError(ValueError):
    """The key file cannot be used; the message says why."""


def load_api_keys(path: Path) -> tuple[bytes, ...]:
    """The keys in a file, one per line; blank lines and lines starting with # are skipped.
    Several keys let one be rotated out while clients move to the next."""
    try:
        lines = path.read_text().splitlines()
    except (OSError, UnicodeDecodeError) as error:
        raise ApiKeyFileError(f"cannot read the API key file {str(path)!r}: {error}") from error
    keys = tuple(line.strip().encode() for line in lines if line.strip() and not line.lstrip().startswith("#"))
    if not keys:
        raise ApiKeyFileError(f"the API key file {str(path)!r} holds no key")
    short = [key for key in keys if len(key) < 16]
    if short:
        raise ApiKeyFileError(f"the API key file {str(path)!r} has {len(short)} key(s) under 16 characters")
    return keys


class ApiKeyInterceptor(grpc.aio.ServerInterceptor):
    def __init__(self, keys: tuple[bytes, ...]) -> None:
        self._keys = keys

    async def intercept_service(
        self,
        continuation: Callable[[grpc.HandlerCallDetails], Awaitable[grpc.RpcMethodHandler]],
        details: grpc.HandlerCallDetails,
    ) -> grpc.RpcMethodHandler:
        handler = await continuation(details)
        if handler is None or details.method.startswith(OPEN_METHOD_PREFIXES):
            return handler
        problem = self._problem(dict(details.invocation_metadata or ()).get(AUTHORIZATION_METADATA))
        if problem is None:
            return handler
        logger.info("event=call_unauthenticated method=%r reason=%r", details.method, problem)
        return refusing_handler(handler, grpc.StatusCode.UNAUTHENTICATED, problem)

    def _problem(self, authorization: str | bytes | None) -> str | None:
        if authorization is None:
            return "this server needs an API key: send metadata 'authorization: Bearer KEY'"
        text = authorization.decode(errors="replace") if isinstance(authorization, bytes) else authorization
        if not text.startswith(BEARER_PREFIX):
            return "the authorization metadata must be 'Bearer KEY'"
        presented = text.removeprefix(BEARER_PREFIX).strip().encode()
        # Every key compared in constant time, so timing tells nothing about any of them.
        matches = [hmac.compare_digest(presented, key) for key in self._keys]
        return None if any(matches) else "the API key is not valid"


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
