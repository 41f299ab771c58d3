"""What every route shares: the gateway's settings, its one AsyncClient and served model, and
the dependencies that hand them (and the caller's API key and tenant) to a route."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Annotated

from fastapi import Depends, Request

from clients.async_client import AsyncClient
from clients.openai_gateway.auth import bearer_token, tenant_header
from clients.openai_gateway.body_limit import (
    DEFAULT_BODY_READ_TIMEOUT_S,
    DEFAULT_MAX_BODY_BYTES,
    DEFAULT_MAX_BODY_BYTES_IN_FLIGHT,
)
from clients.openai_gateway.served_model import ServedModel


@dataclass(slots=True, frozen=True)
class GatewaySettings:
    server: str
    served_model_name: str | None = None
    root_certificates: bytes | None = None
    tls: bool = False
    health_timeout_s: float = 5.0
    max_body_bytes: int = DEFAULT_MAX_BODY_BYTES
    max_body_bytes_in_flight: int = DEFAULT_MAX_BODY_BYTES_IN_FLIGHT
    body_read_timeout_s: float = DEFAULT_BODY_READ_TIMEOUT_S


@dataclass(slots=True, frozen=True)
class Gateway:
    client: AsyncClient
    model: ServedModel
    settings: GatewaySettings
    started: int


def current_gateway(request: Request) -> Gateway:
    return request.app.state.gateway


GatewayDep = Annotated[Gateway, Depends(current_gateway)]
ApiKey = Annotated[str | None, Depends(bearer_token)]
Tenant = Annotated[str | None, Depends(tenant_header)]
