"""The API key file's tenant column: a key alone counts for the default tenant, a key and a name
for that tenant, a key and `*` is a gateway's whose calls name their tenant; anything else is
refused at start with the line that is wrong."""

from __future__ import annotations

from pathlib import Path

import pytest

from scheduler_service.frontend.api_keys import (
    FORWARDER_TENANT,
    ApiKeyFileError,
    load_api_keys,
    load_key_tenants,
)

PLAIN = "plain-key-0123456789"
ACME = "acme-key-0123456789ab"
GATEWAY = "gateway-key-0123456789"


def key_file(tmp_path: Path, text: str) -> Path:
    path = tmp_path / "keys"
    path.write_text(text)
    return path


def test_keys_with_and_without_a_tenant(tmp_path: Path) -> None:
    path = key_file(
        tmp_path,
        f"# clients\n{PLAIN}\n\n   {ACME}   acme  \n# the gateway names the tenant of each call\n{GATEWAY} *\n",
    )
    assert load_key_tenants(path) == {PLAIN.encode(): "", ACME.encode(): "acme", GATEWAY.encode(): FORWARDER_TENANT}
    # The Admin keys' loader reads the same format and keeps the keys.
    assert load_api_keys(path) == (PLAIN.encode(), ACME.encode(), GATEWAY.encode())


def test_a_file_without_tenants_is_read_as_before(tmp_path: Path) -> None:
    assert load_key_tenants(key_file(tmp_path, f"{PLAIN}\n{ACME}\n")) == {PLAIN.encode(): "", ACME.encode(): ""}


def test_three_fields_are_refused_with_the_line(tmp_path: Path) -> None:
    path = key_file(tmp_path, f"{PLAIN}\n{ACME} acme extra\n")
    with pytest.raises(ApiKeyFileError, match="line 2 has 3 fields: a key and at most a tenant name"):
        load_key_tenants(path)


@pytest.mark.parametrize("name", ["-acme", "ac/me", "x" * 65, "**", "ä"])
def test_a_tenant_name_that_cannot_be_one_is_refused_with_the_line(tmp_path: Path, name: str) -> None:
    path = key_file(tmp_path, f"{PLAIN}\n\n{ACME} {name}\n")
    with pytest.raises(ApiKeyFileError, match="line 3: tenant name"):
        load_key_tenants(path)


def test_short_keys_and_empty_files_are_still_refused(tmp_path: Path) -> None:
    with pytest.raises(ApiKeyFileError, match="under 16 characters"):
        load_key_tenants(key_file(tmp_path, "short acme\n"))
    with pytest.raises(ApiKeyFileError, match="holds no key"):
        load_key_tenants(key_file(tmp_path, "# nothing\n\n"))
