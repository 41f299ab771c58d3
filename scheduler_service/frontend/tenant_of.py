"""Whose request a call is: the tenant of the API key it presented (the key file's second
column), or, on a scheduler without keys (behind a gateway that authenticates) or for a key
marked `*` (a gateway's own), the name in its `x-splitserve-tenant` metadata. A keyed client
cannot name another tenant: the metadata is ignored for its key."""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from dataclasses import dataclass

from scheduler_service.core.errors import ErrorKind, RequestRejected
from scheduler_service.core.tenants import DEFAULT_TENANT, check_tenant_name
from scheduler_service.frontend.api_keys import (
    AUTHORIZATION_METADATA,
    FORWARDER_TENANT,
    presented_key,
)

TENANT_METADATA = "x-splitserve-tenant"


@dataclass(slots=True, frozen=True)
class TenantOf:
    # Each client key's tenant ("" default, "*" named by the call); None: the port takes no keys.
    key_tenants: Mapping[bytes, str] | None = None

    def __call__(self, metadata: Iterable[tuple[str, str | bytes]]) -> str:
        """The call's tenant; RequestRejected (INVALID) for a tenant name that cannot be one."""
        values = dict(metadata)
        if self.key_tenants is not None:
            authorization = values.get(AUTHORIZATION_METADATA)
            text = authorization.decode(errors="replace") if isinstance(authorization, bytes) else authorization or ""
            tenant = self.key_tenants.get(presented_key(text), "")
            if tenant != FORWARDER_TENANT:
                return tenant or DEFAULT_TENANT
        named = values.get(TENANT_METADATA)
        if named is None or named == "":
            return DEFAULT_TENANT
        name = named.decode(errors="replace") if isinstance(named, bytes) else named
        try:
            return check_tenant_name(name)
        except ValueError as error:
            raise RequestRejected(ErrorKind.INVALID, f"metadata {TENANT_METADATA}: {error}") from None
