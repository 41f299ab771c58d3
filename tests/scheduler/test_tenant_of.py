"""Whose request a call is: the tenant of its API key; x-splitserve-tenant only where the port
takes no keys (a gateway in front authenticates) or for a gateway's `*` key. A keyed client
cannot name another tenant, and a name that cannot be a tenant's is refused as INVALID."""

from __future__ import annotations

import pytest

from scheduler_service.core.errors import ErrorKind, RequestRejected
from scheduler_service.core.tenants import DEFAULT_TENANT
from scheduler_service.frontend.api_keys import FORWARDER_TENANT
from scheduler_service.frontend.tenant_of import TENANT_METADATA, TenantOf

ACME_KEY = b"acme-key-0123456789ab"
PLAIN_KEY = b"plain-key-0123456789"
GATEWAY_KEY = b"gateway-key-0123456789"
KEYED = TenantOf({ACME_KEY: "acme", PLAIN_KEY: "", GATEWAY_KEY: FORWARDER_TENANT})


def bearer(key: bytes) -> tuple[str, str]:
    return ("authorization", f"Bearer {key.decode()}")


def test_without_keys_the_metadata_names_the_tenant() -> None:
    open_port = TenantOf(None)
    assert open_port([(TENANT_METADATA, "acme")]) == "acme"
    assert open_port([(TENANT_METADATA, b"globex")]) == "globex"
    assert open_port([]) == DEFAULT_TENANT
    assert open_port([(TENANT_METADATA, "")]) == DEFAULT_TENANT
    # Whatever key a call carries, a port without keys does not read it.
    assert open_port([bearer(ACME_KEY), (TENANT_METADATA, "globex")]) == "globex"


def test_a_keyed_call_counts_for_its_keys_tenant_whatever_its_metadata_says() -> None:
    assert KEYED([bearer(ACME_KEY)]) == "acme"
    assert KEYED([bearer(ACME_KEY), (TENANT_METADATA, "globex")]) == "acme"
    assert KEYED([bearer(PLAIN_KEY), (TENANT_METADATA, "globex")]) == DEFAULT_TENANT
    # Not even a bad name is looked at.
    assert KEYED([bearer(ACME_KEY), (TENANT_METADATA, "not a name")]) == "acme"


def test_a_gateways_key_passes_on_the_tenant_its_call_names() -> None:
    assert KEYED([bearer(GATEWAY_KEY), (TENANT_METADATA, "globex")]) == "globex"
    assert KEYED([(TENANT_METADATA, "globex"), ("authorization", f"Bearer {GATEWAY_KEY.decode()}".encode())]) == "globex"
    assert KEYED([bearer(GATEWAY_KEY)]) == DEFAULT_TENANT


@pytest.mark.parametrize("tenant_of", [TenantOf(None), KEYED], ids=["no-keys", "gateway-key"])
@pytest.mark.parametrize("name", ["not a name", "-acme", "x" * 65, b"\xff\xfe", "a/b"])
def test_a_name_that_cannot_be_a_tenants_is_invalid(tenant_of: TenantOf, name: str | bytes) -> None:
    with pytest.raises(RequestRejected, match=TENANT_METADATA) as rejected:
        tenant_of([bearer(GATEWAY_KEY), (TENANT_METADATA, name)])
    assert rejected.value.kind is ErrorKind.INVALID
