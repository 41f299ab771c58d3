"""Checking and picking TCP ports before the services bind them."""

from __future__ import annotations

import socket


class PortTaken(Exception):
    """A fixed port is already listened on, most likely by an earlier launch still running."""


def port_taken(host: str, port: int) -> bool:
    family = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM)[0][0]
    try:
        # create_server sets SO_REUSEADDR, so only a live listener, not TIME_WAIT, counts.
        socket.create_server((host, port), family=family).close()
    except OSError:
        return True
    return False


def free_port(host: str) -> int:
    """A port free right now; the scheduler does not report its metrics port, so the launcher
    picks one to be able to print it."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind((host, 0))
        return int(sock.getsockname()[1])
