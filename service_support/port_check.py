"""Trying, before a service spends seconds to minutes loading, the address and ports it will
bind: a taken port would otherwise fail only once the model or tokenizer is loaded."""

from __future__ import annotations

import errno
import socket
from collections.abc import Mapping


class PortUnavailable(ValueError):
    """A host or port a service was asked to listen on cannot be had; the message names the flag
    and what to do."""


def bind_error(host: str, port: int) -> OSError | None:
    """Why host:port cannot be listened on right now, or None when it can."""
    # "[::]" is how gRPC addresses spell IPv6; "" is every address, as INADDR_ANY.
    name = host.strip("[]")
    try:
        family = socket.getaddrinfo(name, port, type=socket.SOCK_STREAM)[0][0] if name else socket.AF_INET
        # create_server sets SO_REUSEADDR, so only a live listener, not TIME_WAIT, counts.
        socket.create_server((name, port), family=family).close()
    except OSError as error:
        return error
    return None


def port_taken(host: str, port: int) -> bool:
    return bind_error(host, port) is not None


def check_listen_ports(host: str, ports: Mapping[str, int | None]) -> None:
    """Raises PortUnavailable unless host is an address of this machine and each flag's port
    can be bound there now, no two alike. Port 0 (any free port) and None (off) always can."""
    host_error = bind_error(host, 0)
    if host_error is not None:
        raise PortUnavailable(
            f"--host {host} is not an address this machine can listen on ({_reason(host_error)}); "
            "pass 127.0.0.1, 0.0.0.0 (every address) or one of its own addresses"
        )
    flags_by_port: dict[int, str] = {}
    for flag, port in ports.items():
        if port and port in flags_by_port:
            raise PortUnavailable(
                f"{flag} {port} is {flags_by_port[port]}'s port too; give each its own (0 picks a "
                "free one)"
            )
        if port:
            flags_by_port[port] = flag
    for port, flag in flags_by_port.items():
        error = bind_error(host, port)
        if error is not None:
            raise PortUnavailable(_problem(flag, host, port, error))


def _problem(flag: str, host: str, port: int, error: OSError) -> str:
    where = f"{host}:{port} ({flag})"
    if error.errno == errno.EADDRINUSE:
        return (
            f"{where} is already in use; stop what listens there, or pass another {flag} "
            "(0 picks a free port)"
        )
    if error.errno == errno.EACCES:
        return f"{where} needs privileges this process lacks; pass a port above 1023"
    return f"cannot listen on {where}: {_reason(error)}"


def _reason(error: OSError) -> str:
    return error.strerror or str(error)
