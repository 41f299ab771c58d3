"""The command line of the scheduler tier: which role this process plays, and how the roles find
and trust each other."""

import argparse
import os
from dataclasses import dataclass
from pathlib import Path

from protos.executor_access import read_token_file
from service_support.transport_security import ClientTls, client_tls

ROLES = ("all", "planner", "frontend")
# Front-ends the all-in-one scheduler runs by default: one (this very process, no planner link)
# on small machines, where a second process would only share the same cores; on larger ones a
# front-end per four cores, as delivering tokens costs about ten times what planning them does.
MAX_AUTO_FRONTENDS = 8


@dataclass(slots=True, frozen=True)
class RoleOptions:
    role: str
    frontends: int
    planners: tuple[str, ...]
    planner_token: str | None
    insecure_planner: bool
    reuse_port: bool
    # Role frontend: how it verifies planners that serve TLS (None: plaintext).
    planner_tls: ClientTls | None = None


def add_role_flags(parser: argparse.ArgumentParser) -> None:
    group = parser.add_argument_group("scheduler tier (README: The scheduler as a tier)")
    group.add_argument(
        "--role",
        choices=ROLES,
        default="all",
        help="all: a planner and --frontends front-ends; planner: the executors, served to "
        "front-ends over the Planner API on --port; frontend: the client port, planned by --planner",
    )
    group.add_argument(
        "--frontends",
        default="auto",
        metavar="N|auto",
        help="role all: front-end processes sharing --port; 1 runs everything in this process; "
        "auto: one per four cores, at most 8, at least 1",
    )
    group.add_argument(
        "--planner",
        action="append",
        default=[],
        metavar="HOST:PORT",
        help="role frontend: a planner to use (repeat for a standby: the front-end moves its "
        "requests to the next planner up when its planner is lost)",
    )
    group.add_argument(
        "--planner-token-file",
        type=Path,
        help="the planners' shared token (first line of the file), required by a planner and sent by "
        "front-ends; role all makes one of its own",
    )
    group.add_argument(
        "--insecure-planner",
        action="store_true",
        help="role planner: take front-ends without a token (anyone who reaches the port can submit "
        "requests and drain executors); logged as a warning",
    )
    group.add_argument(
        "--planner-tls-ca",
        type=Path,
        help="role frontend: PEM CA that signed the planners' certificates; connects to planners "
        "over TLS (a planner serves TLS on its Planner API with --tls-cert and --tls-key)",
    )
    group.add_argument(
        "--planner-tls-server-name",
        help="role frontend: the name the planners' certificates carry, when it is not the host "
        "dialled",
    )
    group.add_argument(
        "--planner-tls-cert",
        type=Path,
        help="role frontend: PEM client certificate presented to planners (mutual TLS: a planner "
        "started with --tls-client-ca takes only front-ends presenting one its CA signed)",
    )
    group.add_argument("--planner-tls-key", type=Path, help="role frontend: PEM private key of --planner-tls-cert")
    group.add_argument(
        "--reuse-port",
        action="store_true",
        help="role frontend: share --port with other front-ends (SO_REUSEPORT); the all-in-one "
        "scheduler sets it for the front-ends it starts",
    )


def role_options(args: argparse.Namespace) -> RoleOptions:
    """ValueError saying what is wrong with the role flags."""
    frontends = auto_frontends() if args.frontends == "auto" else _count(args.frontends)
    token = read_token_file(args.planner_token_file) if args.planner_token_file else None
    if args.role == "frontend" and not args.planner:
        raise ValueError("--role frontend needs --planner HOST:PORT (repeat for a standby)")
    if args.role == "planner" and (args.api_key_file or args.admin_key_file):
        # Taking them silently would leave whoever set them believing the planner's port checks them.
        raise ValueError(
            "a planner serves no client API: give --api-key-file and --admin-key-file to its "
            "front-ends (the planner's own port, Admin included, takes only the planner token)"
        )
    if args.role == "planner" and token is None and not args.insecure_planner:
        raise ValueError(
            "a planner is closed by default: give it --planner-token-file FILE (and its front-ends "
            "the same file), or --insecure-planner where nothing else reaches its port"
        )
    planner_tls = None
    planner_flags = (args.planner_tls_ca, args.planner_tls_server_name, args.planner_tls_cert, args.planner_tls_key)
    if any(flag is not None for flag in planner_flags):
        if args.role != "frontend":
            # The all-in-one scheduler's own planner listens on loopback only, in plaintext.
            raise ValueError("--planner-tls-ca, --planner-tls-server-name, --planner-tls-cert and --planner-tls-key are for --role frontend")
        if args.planner_tls_ca is None:
            raise ValueError("--planner-tls-server-name, --planner-tls-cert and --planner-tls-key need --planner-tls-ca")
        if (args.planner_tls_cert is None) != (args.planner_tls_key is None):
            raise ValueError("--planner-tls-cert and --planner-tls-key go together")
        planner_tls = client_tls(
            args.planner_tls_ca, args.planner_tls_cert, args.planner_tls_key, args.planner_tls_server_name
        )
    return RoleOptions(
        args.role, frontends, tuple(args.planner), token, args.insecure_planner, args.reuse_port, planner_tls
    )


def auto_frontends() -> int:
    return max(1, min(MAX_AUTO_FRONTENDS, len(os.sched_getaffinity(0)) // 4))


def _count(text: str) -> int:
    if not text.isdigit() or int(text) < 1:
        raise ValueError(f"--frontends must be a whole number of at least 1 or auto, got {text!r}")
    return int(text)
