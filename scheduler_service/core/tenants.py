"""Tenants: who a request is for, each tenant's weight under the fair policy, and its quotas.

A request's tenant is its API key's (the key file's second column), or, where the scheduler has
no keys (behind a gateway that authenticates), the caller's `x-splitserve-tenant` metadata
(frontend/tenant_of.py). The weights and quotas come from --tenants-file, a TOML file:

    [defaults]               # every tenant the file does not name
    weight = 1
    max_running = 64

    [tenants.acme]
    weight = 4               # four times the default's share under --policy fair
    max_running = 32         # most requests placed on executors at once; more wait here
    max_waiting = 100        # most waiting here; past both a request gets RESOURCE_EXHAUSTED
    tokens_per_minute = 200000   # prompt + max_tokens asked for in any 60 s

Every key is optional; a missing quota is no limit.
"""

from __future__ import annotations

import math
import re
import tomllib
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path

DEFAULT_TENANT = "default"
# What a tenant name may be: it becomes a metric label and a log field.
TENANT_NAME = re.compile(r"[A-Za-z0-9][A-Za-z0-9._-]{0,63}")
_LIMIT_KEYS = ("weight", "max_running", "max_waiting", "tokens_per_minute")


class TenantsFileError(ValueError):
    """The tenants file cannot be used; the message says why."""


@dataclass(slots=True, frozen=True)
class TenantLimits:
    # Share under the fair policy, relative to the others' (> 0).
    weight: float = 1.0
    # Most requests placed on executors at once; None: no limit.
    max_running: int | None = None
    # Most requests waiting for room under max_running; None: no limit.
    max_waiting: int | None = None
    # Most tokens (prompt + max_tokens) asked for in any 60 s; None: no limit.
    tokens_per_minute: int | None = None

    def __post_init__(self) -> None:
        if not (self.weight > 0 and math.isfinite(self.weight)):
            raise ValueError(f"weight must be a positive number, got {self.weight}")
        for name in ("max_running", "tokens_per_minute"):
            value = getattr(self, name)
            if value is not None and value < 1:
                raise ValueError(f"{name} must be at least 1, got {value}")
        if self.max_waiting is not None and self.max_waiting < 0:
            raise ValueError(f"max_waiting must not be negative, got {self.max_waiting}")


@dataclass(slots=True, frozen=True)
class TenantTable:
    """The tenants file in force: named tenants' limits, and the defaults for every other."""

    tenants: Mapping[str, TenantLimits] = field(default_factory=dict)
    defaults: TenantLimits = TenantLimits()
    # The file it was read from; None: built in (no --tenants-file).
    source: Path | None = None

    def limits(self, tenant: str) -> TenantLimits:
        return self.tenants.get(tenant, self.defaults)


def check_tenant_name(name: str) -> str:
    """The name, or ValueError saying why it cannot name a tenant."""
    if TENANT_NAME.fullmatch(name) is None:
        raise ValueError(
            f"tenant name {name[:80]!r} must be 1-64 letters, digits, '.', '_' or '-', starting "
            "with a letter or digit"
        )
    return name


def load_tenants_file(path: Path) -> TenantTable:
    """The table a tenants file describes; TenantsFileError saying what is wrong."""
    try:
        document = tomllib.loads(path.read_text())
    except (OSError, UnicodeDecodeError, tomllib.TOMLDecodeError) as error:
        raise TenantsFileError(f"cannot read the tenants file {str(path)!r}: {error}") from error
    unknown = set(document) - {"defaults", "tenants"}
    if unknown:
        raise TenantsFileError(f"the tenants file {str(path)!r} has unknown tables {sorted(unknown)}: only [defaults] and [tenants.NAME]")
    named = document.get("tenants", {})
    try:
        if not isinstance(named, dict):
            raise ValueError("tenants must be a table of [tenants.NAME] tables")
        defaults = _limits(document.get("defaults", {}), "[defaults]")
        tenants = {
            check_tenant_name(name): _limits(table, f"[tenants.{name}]")
            for name, table in named.items()
        }
    except (TypeError, ValueError) as error:
        raise TenantsFileError(f"the tenants file {str(path)!r}: {error}") from error
    return TenantTable(tenants, defaults, path)


def _limits(table: object, where: str) -> TenantLimits:
    if not isinstance(table, dict):
        raise ValueError(f"{where} must be a table")
    unknown = set(table) - set(_LIMIT_KEYS)
    if unknown:
        raise ValueError(f"{where} has unknown keys {sorted(unknown)}; known: {', '.join(_LIMIT_KEYS)}")
    for key, value in table.items():
        if isinstance(value, bool) or not isinstance(value, int | float) or (key != "weight" and not isinstance(value, int)):
            raise ValueError(f"{where} {key} must be a {'number' if key == 'weight' else 'whole number'}, got {value!r}")
    try:
        return TenantLimits(**table)
    except ValueError as error:
        raise ValueError(f"{where}: {error}") from None
