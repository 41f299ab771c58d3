"""`python -m clients.openai_gateway [--port 8000] [--server 127.0.0.1:50051]`: the
OpenAI-compatible HTTP gateway in front of a scheduler. Logs `event=gateway_ready address=HOST:PORT` once it listens
(with --port 0, the port the system picked)."""

from __future__ import annotations

import argparse
import contextlib
import logging
import socket
import sys
from collections.abc import Iterator, Sequence
from pathlib import Path

import uvicorn

from clients.openai_gateway.app import GatewaySettings, create_app
from clients.openai_gateway.body_limit import (
    DEFAULT_BODY_READ_TIMEOUT_S,
    DEFAULT_MAX_BODY_BYTES,
    DEFAULT_MAX_BODY_BYTES_IN_FLIGHT,
    check_budget,
)
from service_support.cli_help import DefaultsHelpFormatter
from service_support.default_ports import (
    DEFAULT_GATEWAY_PORT,
    DEFAULT_SCHEDULER_ADDRESS,
)
from service_support.flag_types import non_negative_float, port_number, positive_float, positive_int
from service_support.log_format import add_log_format_flag, configure_logging
from service_support.parent_death import end_with_parent
from service_support.port_check import PortUnavailable, check_listen_ports

logger = logging.getLogger("clients.openai_gateway")


def parse_args(argv: Sequence[str] | None, prog: str = "python -m clients.openai_gateway") -> argparse.Namespace:
    parser = argparse.ArgumentParser(
        prog=prog,
        description=__doc__,
        formatter_class=DefaultsHelpFormatter,
    )
    parser.add_argument("--port", type=port_number, default=DEFAULT_GATEWAY_PORT, help="HTTP port (0: any free one)")
    parser.add_argument("--host", default="127.0.0.1", help="address to listen on")
    parser.add_argument(
        "--server", default=DEFAULT_SCHEDULER_ADDRESS, metavar="HOST:PORT", help="the scheduler's client API"
    )
    parser.add_argument(
        "--served-model-name",
        help="the name clients must send as `model` (default: the model_id GetModelInfo reports)",
    )
    parser.add_argument("--tls-ca", type=Path, help="PEM CA of the scheduler's certificate: connect over TLS")
    parser.add_argument("--tls", action="store_true", help="connect over TLS trusting the system's root certificates")
    parser.add_argument(
        "--max-body-bytes",
        type=positive_int,
        default=DEFAULT_MAX_BODY_BYTES,
        help="largest request body taken; a larger one is answered 413 before it is read",
    )
    parser.add_argument(
        "--max-body-bytes-in-flight",
        type=positive_int,
        default=DEFAULT_MAX_BODY_BYTES_IN_FLIGHT,
        help="request bodies held at once by the requests in progress, all together (the gateway's "
        "memory peaks at five to six times this); a body past it is answered 503 with Retry-After, unread. "
        "At least --max-body-bytes",
    )
    parser.add_argument(
        "--body-read-timeout",
        type=positive_float,
        default=DEFAULT_BODY_READ_TIMEOUT_S,
        help="seconds a request body may go without a byte arriving; past it, 408 and the connection "
        "closed (a stalled body holds its share of --max-body-bytes-in-flight that long at most)",
    )
    add_log_format_flag(parser)
    parser.add_argument(
        "--drain-timeout",
        type=non_negative_float,
        default=25.0,
        help="after SIGTERM, seconds open responses get to finish before they are cut",
    )
    return parser.parse_args(argv)


class GatewayServer(uvicorn.Server):
    """uvicorn's server, logging the ready line once the application started and it listens."""

    def __init__(self, config: uvicorn.Config, listener: socket.socket, settings: GatewaySettings) -> None:
        super().__init__(config)
        self._listener = listener
        self._settings = settings

    @contextlib.contextmanager
    def capture_signals(self) -> Iterator[None]:
        with super().capture_signals():
            yield
            # uvicorn re-raises SIGTERM after its graceful shutdown, so the process would die of
            # it; a drained stop is a clean exit (status 0) here, as for the other services.
            self._captured_signals.clear()

    async def startup(self, sockets: list[socket.socket] | None = None) -> None:
        await super().startup(sockets=sockets)
        if self.started:
            host, port = self._listener.getsockname()[:2]
            address = f"[{host}]:{port}" if ":" in host else f"{host}:{port}"
            logger.info(
                "event=gateway_ready address=%s server=%s served_model_name=%s tls=%s",
                address, self._settings.server, self._settings.served_model_name,
                self._settings.tls or self._settings.root_certificates is not None,
            )


def listen(host: str, port: int) -> socket.socket:
    """The listening socket, bound here so that port 0 gets one port for every address family
    and the ready line can name it."""
    family, kind, proto, _, address = socket.getaddrinfo(
        host, port, type=socket.SOCK_STREAM, flags=socket.AI_PASSIVE
    )[0]
    listener = socket.socket(family, kind, proto)
    listener.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    listener.bind(address)
    listener.listen(socket.SOMAXCONN)
    listener.setblocking(False)
    return listener


def main(argv: Sequence[str] | None = None, prog: str = "python -m clients.openai_gateway") -> int:
    args = parse_args(argv, prog)
    configure_logging(args.log_format)
    end_with_parent()
    try:
        root_certificates = args.tls_ca.read_bytes() if args.tls_ca else None
        check_budget(args.max_body_bytes, args.max_body_bytes_in_flight)
        check_listen_ports(args.host, {"--port": args.port})
        listener = listen(args.host, args.port)
    except (OSError, PortUnavailable, ValueError) as error:
        logger.error("event=gateway_refused reason=%r", str(error))
        return 2
    settings = GatewaySettings(
        server=args.server,
        served_model_name=args.served_model_name,
        root_certificates=root_certificates,
        tls=args.tls,
        max_body_bytes=args.max_body_bytes,
        max_body_bytes_in_flight=args.max_body_bytes_in_flight,
        body_read_timeout_s=args.body_read_timeout,
    )
    config = uvicorn.Config(
        create_app(settings),
        # Our logging setup stays; uvicorn's own lines (not key=value) only for warnings. The
        # routes log each request as structured lines, so its access log is off.
        log_config=None,
        log_level="warning",
        access_log=False,
        timeout_graceful_shutdown=args.drain_timeout,
    )
    server = GatewayServer(config, listener, settings)
    server.run(sockets=[listener])
    return 0 if server.started else 1


if __name__ == "__main__":
    sys.exit(main())
