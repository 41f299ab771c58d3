"""The caller's bearer token, forwarded to the scheduler as its API key.

The gateway holds no keys: the scheduler's --api-key-file decides, per request, exactly as for
gRPC clients. A scheduler without keys ignores the token (the openai package always sends one).
"""

from __future__ import annotations

from starlette.requests import Request

from clients.openai_gateway.errors import GatewayError


def bearer_token(request: Request) -> str | None:
    header = request.headers.get("authorization")
    if header is None:
        return None
    scheme, _, token = header.partition(" ")
    token = token.strip()
    if scheme.lower() != "bearer" or not token:
        raise GatewayError(
            401, "the Authorization header must be `Bearer <API key>`", code="invalid_api_key"
        )
    return token
