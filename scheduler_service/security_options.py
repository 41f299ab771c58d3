"""The scheduler's security flags and what they load: TLS of the client port, the client and
admin API keys, and how it proves itself to executors (TLS client certificate, shared token).
Every file is read at start, so a wrong path or a missing half of a pair stops the start with a
one-line reason instead of failing the first call."""

from __future__ import annotations

import argparse
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path

from protos.executor_access import read_token_file
from scheduler_service.frontend.api_keys import load_api_keys, load_key_tenants
from service_support.health_port import add_health_port_flag
from service_support.transport_security import (
    ClientTls,
    ServerTls,
    TlsConfigError,
    client_tls,
    server_tls,
)


@dataclass(slots=True, frozen=True)
class SecurityOptions:
    tls: ServerTls | None
    # Each client key with its tenant.
    api_keys: Mapping[bytes, str] | None
    admin_keys: tuple[bytes, ...] | None
    executor_tls: ClientTls | None
    executor_token: str | None


def add_security_flags(parser: argparse.ArgumentParser) -> None:
    group = parser.add_argument_group("security")
    group.add_argument("--tls-cert", type=Path, help="PEM certificate (chain) of the client API (with --role planner: of the Planner API); serves TLS")
    group.add_argument("--tls-key", type=Path, help="PEM private key of --tls-cert")
    group.add_argument(
        "--tls-client-ca",
        type=Path,
        help="with --role planner: PEM CA that front-ends' client certificates must chain to "
        "(mutual TLS on the Planner API; they present one with --planner-tls-cert/-key), besides "
        "the planner token",
    )
    group.add_argument(
        "--api-key-file",
        type=Path,
        help="bearer tokens, one per line: every call but grpc.health.v1 and Admin must send "
        "'authorization: Bearer KEY' with one of them. A key may be followed by the tenant its "
        "requests count for (--tenants-file), or by '*' for a gateway's key whose calls name "
        "their tenant in x-splitserve-tenant",
    )
    group.add_argument(
        "--admin-key-file",
        type=Path,
        help="bearer tokens, one per line, that the Admin service (drain, scheduling knobs, "
        "audit) takes; client keys never open it. Without it Admin is closed when "
        "--api-key-file is set, and open when no keys are",
    )
    group.add_argument(
        "--executor-token-file",
        type=Path,
        help="the executors' shared token (its first line), sent on every Executor API call: the "
        "same file as each executor's --executor-token-file",
    )
    group.add_argument("--executor-tls-ca", type=Path, help="PEM CA that signed the executors' certificates; connects to executors over TLS")
    group.add_argument("--executor-tls-cert", type=Path, help="PEM client certificate presented to executors (mutual TLS); its common name, with --scheduler-id, is this scheduler's identity to them")
    group.add_argument("--executor-tls-key", type=Path, help="PEM private key of --executor-tls-cert")
    group.add_argument(
        "--executor-tls-server-name",
        help="name the executors' certificates carry, when it is not the address dialled "
        "(needed with dns:/// executors, which are dialled by IP)",
    )
    add_health_port_flag(group)


def security_options(args: argparse.Namespace) -> SecurityOptions:
    """What the flags name, loaded; ValueError (TlsConfigError, ApiKeyFileError,
    TokenFileError) saying what is wrong."""
    if args.tls_client_ca is not None and args.role != "planner":
        # A client-API port takes API keys (--api-key-file): client certificates there would
        # lock out the CLI, the gateway and every client that sends none.
        raise TlsConfigError("--tls-client-ca is for --role planner (its front-ends' client certificates)")
    executor_tls = None
    wants_tls = args.executor_tls_cert or args.executor_tls_key or args.executor_tls_server_name
    if wants_tls and args.executor_tls_ca is None:
        raise TlsConfigError("--executor-tls-cert/-key/-server-name need --executor-tls-ca")
    if args.executor_tls_ca is not None:
        executor_tls = client_tls(
            args.executor_tls_ca, args.executor_tls_cert, args.executor_tls_key, args.executor_tls_server_name
        )
    return SecurityOptions(
        tls=server_tls(args.tls_cert, args.tls_key, args.tls_client_ca),
        api_keys=load_key_tenants(args.api_key_file) if args.api_key_file else None,
        admin_keys=load_api_keys(args.admin_key_file) if args.admin_key_file else None,
        executor_tls=executor_tls,
        executor_token=read_token_file(args.executor_token_file) if args.executor_token_file else None,
    )
