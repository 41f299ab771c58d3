"""The caller's bearer token, forwarded to the scheduler as its API key.

The gateway holds no keys: the scheduler's --api-key-file decides, per request, exactly as for
gRPC clients. A scheduler without keys ignores the token (the openai package always sends one); an empty
one is no token.
A token that could not be a key is refused here with 401: gRPC metadata takes printable ASCII
only and a few kilobytes in all, so passed on it would fail as a 500 or a 429 instead.
"""

from __future__ import annotations

import re

from starlette.requests import Request

from clients.openai_gateway.errors import GatewayError

# Far above any key worth having, far below gRPC's 8 KiB of metadata per call.
MAX_BEARER_CHARS = 1024
# Printable ASCII without spaces: what a gRPC metadata value can carry as one token.
BEARER_TOKEN = re.compile(r"[!-~]+")


def bearer_token(request: Request) -> str | None:
    header = request.headers.get("authorization")
    if header is None:
        return None
    scheme, _, token = header.partition(" ")
    token = token.strip()
    if scheme.lower() != "bearer":
        raise invalid_key("the Authorization header must be `Bearer <API key>`")
    if not token:
        # What a client with no key configured sends (lm-evaluation-harness: "Bearer " and
        # HTTP trims the space): no key, which a scheduler with keys refuses itself.
        return None
    if len(token) > MAX_BEARER_CHARS:
        raise invalid_key(f"the API key is longer than {MAX_BEARER_CHARS} characters")
    if BEARER_TOKEN.fullmatch(token) is None:
        raise invalid_key("the API key must be printable ASCII without spaces")
    return token


def invalid_key(message: str) -> GatewayError:
    return GatewayError(401, message, code="invalid_api_key")
