"""The caller's bearer token, forwarded to the scheduler as its API key, and the tenant its
`x-splitserve-tenant` header names, forwarded as the metadata of that name.

The gateway holds no keys: the scheduler's --api-key-file decides, per request, exactly as for
gRPC clients. A scheduler without keys ignores the token (the openai package always sends one); an empty
one is no token.
A token that could not be a key is refused here with 401: gRPC metadata takes printable ASCII
only and a few kilobytes in all, so passed on it would fail as a 500 or a 429 instead.

Tenants (fair shares, quotas) follow from the same forwarding: the key file's second column
names each key's tenant, so a request through the gateway counts for its bearer token's tenant
as a gRPC call with that key does. The header counts only where the scheduler lets a call name
its tenant: on a scheduler without keys (the gateway, or a proxy before it, authenticates), or
for a key the key file marks `*` (a trusted front that says whom each request is for). For any
other key the scheduler ignores it, so a caller cannot spend another tenant's share. A header
that could not be metadata is refused here with 400; whether it names a tenant is the
scheduler's to say (400 too).
"""

from __future__ import annotations

import re

from starlette.requests import Request

from clients.connection import TENANT_METADATA
from clients.openai_gateway.errors import GatewayError

# Far above any key worth having, far below gRPC's 8 KiB of metadata per call.
MAX_BEARER_CHARS = 1024
# Printable ASCII without spaces: what a gRPC metadata value can carry as one token.
BEARER_TOKEN = re.compile(r"[!-~]+")
# Above the scheduler's 64 characters, so that it names the rule a longer name breaks.
MAX_TENANT_CHARS = 256


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


def tenant_header(request: Request) -> str | None:
    """The tenant the caller names, or None (an absent or empty header: the key's, or the
    default tenant)."""
    name = request.headers.get(TENANT_METADATA, "").strip()
    if not name:
        return None
    if len(name) > MAX_TENANT_CHARS:
        raise invalid_tenant(f"the {TENANT_METADATA} header is longer than {MAX_TENANT_CHARS} characters")
    if BEARER_TOKEN.fullmatch(name) is None:
        raise invalid_tenant(f"the {TENANT_METADATA} header must be printable ASCII without spaces")
    return name


def invalid_key(message: str) -> GatewayError:
    return GatewayError(401, message, code="invalid_api_key")


def invalid_tenant(message: str) -> GatewayError:
    return GatewayError(400, message, param=TENANT_METADATA, code="invalid_tenant")
