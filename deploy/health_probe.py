"""Health probe for container healthchecks: exits 0 when the server reports SERVING.

    python deploy/health_probe.py HOST:PORT [SERVICE] [--tls-ca PEM] [--timeout SECONDS]   (grpc.health.v1)
    python deploy/health_probe.py http://HOST:PORT/health [--timeout SECONDS]  (HTTP 200)

SERVICE defaults to "" (the server's overall health). --tls-ca probes a TLS port, trusting that
CA: a scheduler front-end serves health only on its client port (no API key needed for it). The
exit status is what docker-compose and Kubernetes exec probes read; the one line printed says
why, for `docker inspect`.
"""

from __future__ import annotations

import argparse
import sys
import urllib.error
import urllib.request
from collections.abc import Sequence
from pathlib import Path

import grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc


def channel_to(address: str, tls_ca: Path | None) -> grpc.Channel:
    if tls_ca is None:
        return grpc.insecure_channel(address)
    return grpc.secure_channel(address, grpc.ssl_channel_credentials(tls_ca.read_bytes()))


def check(address: str, service: str, timeout_s: float, tls_ca: Path | None = None) -> tuple[bool, str]:
    with channel_to(address, tls_ca) as channel:
        stub = health_pb2_grpc.HealthStub(channel)
        try:
            response = stub.Check(health_pb2.HealthCheckRequest(service=service), timeout=timeout_s)
        except grpc.RpcError as error:
            return False, f"{error.code().name}: {error.details()}"
    status = health_pb2.HealthCheckResponse.ServingStatus.Name(response.status)
    return response.status == health_pb2.HealthCheckResponse.SERVING, status


def check_http(url: str, timeout_s: float) -> tuple[bool, str]:
    try:
        with urllib.request.urlopen(url, timeout=timeout_s) as reply:
            return reply.status == 200, f"HTTP {reply.status}"
    except urllib.error.HTTPError as error:
        return False, f"HTTP {error.code}"
    except OSError as error:
        return False, str(error)


def parse_args(argv: Sequence[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(prog="health_probe", description=__doc__.splitlines()[0])
    parser.add_argument("address", metavar="HOST:PORT|URL")
    parser.add_argument("service", nargs="?", default="")
    parser.add_argument("--timeout", type=float, default=3.0, help="seconds")
    parser.add_argument("--tls-ca", type=Path, help="PEM CA of the server's certificate: probe over TLS")
    return parser.parse_args(argv)


def main(argv: Sequence[str] | None = None) -> int:
    args = parse_args(argv)
    if args.address.startswith(("http://", "https://")):
        serving, why = check_http(args.address, args.timeout)
    else:
        serving, why = check(args.address, args.service, args.timeout, args.tls_ca)
    print(f"{args.address} {args.service or '(overall)'}: {why}")
    return 0 if serving else 1


if __name__ == "__main__":
    sys.exit(main())
