"""Checking and picking TCP ports before the services bind them."""

from __future__ import annotations

import socket

# The services check their own ports with the same helper (protos/port_check.py).
from protos.port_check import port_taken

__all__ = ["PortTaken", "free_port", "port_taken"]


class PortTaken(Exception):
    """A fixed port is already listened on, most likely by an earlier launch still running."""


def free_port(host: str) -> int:
    """A port free right now; the scheduler does not report its metrics port, so the launcher
    picks one to be able to print it."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind((host, 0))
        return int(sock.getsockname()[1])
