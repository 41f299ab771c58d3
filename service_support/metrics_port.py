"""A service's Prometheus endpoint (the scheduler's, the executor's), on the port asked for or,
with 0, on one the system picks: the port it bound is what its log reports, so nobody has to
pick a free port beforehand and race another process for it."""

from __future__ import annotations

from prometheus_client import CollectorRegistry, start_http_server


def serve_metrics(port: int | None, host: str, registry: CollectorRegistry) -> int | None:
    """Starts serving registry over HTTP (port None: not at all); returns the bound port."""
    if port is None:
        return None
    server, _ = start_http_server(port, addr=host, registry=registry)
    return int(server.server_port)
