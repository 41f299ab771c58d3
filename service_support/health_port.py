"""A second, plaintext port that serves only grpc.health.v1: probes (Kubernetes' gRPC probe,
docker healthchecks) cannot present TLS or client certificates, and on a mutual-TLS port they
would fail the handshake. It reports exactly what the main port's health service reports."""

from __future__ import annotations

import argparse

import grpc
from grpc_health.v1 import health, health_pb2_grpc

from service_support.flag_types import port_number


def add_health_port_flag(parser: argparse._ActionsContainer) -> None:
    parser.add_argument(
        "--health-port",
        type=port_number,
        help="also serve grpc.health.v1 alone, in plaintext, on this port (for probes that cannot "
        "do TLS)",
    )


async def start_health_port(
    servicer: health.aio.HealthServicer, host: str, port: int
) -> tuple[grpc.aio.Server, int]:
    """Starts a health-only server on host:port; returns it and the port bound (port 0 picks a
    free one)."""
    server = grpc.aio.server(options=[("grpc.so_reuseport", 0)])
    health_pb2_grpc.add_HealthServicer_to_server(servicer, server)
    bound = server.add_insecure_port(f"{host}:{port}")
    if bound == 0:
        raise OSError(f"could not bind the health port {host}:{port}")
    await server.start()
    return server, bound
