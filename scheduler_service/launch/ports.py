"""Picking a TCP port for a service whose own log does not name it."""

from __future__ import annotations

import socket


def free_port(host: str) -> int:
    """A port free right now; the scheduler does not report its metrics port, so the launcher
    picks one to be able to print it."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind((host, 0))
        return int(sock.getsockname()[1])
