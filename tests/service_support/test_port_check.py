"""Checking a service's host and ports before it loads anything."""

from __future__ import annotations

import socket

import pytest

from service_support.port_check import PortUnavailable, check_listen_ports, port_taken
from tests.helpers.service_process import free_port


def test_free_ports_zero_and_off_pass() -> None:
    free = free_port()
    check_listen_ports("127.0.0.1", {"--port": free, "--health-port": 0, "--metrics-port": None})
    assert not port_taken("127.0.0.1", free)


def test_a_taken_port_names_its_flag() -> None:
    with socket.create_server(("127.0.0.1", 0)) as held:
        port = held.getsockname()[1]
        assert port_taken("127.0.0.1", port)
        with pytest.raises(PortUnavailable, match=rf"^127\.0\.0\.1:{port} \(--metrics-port\) is already in use"):
            check_listen_ports("127.0.0.1", {"--port": 0, "--metrics-port": port})


def test_the_same_port_for_two_flags_is_refused_before_any_is_tried() -> None:
    with socket.create_server(("127.0.0.1", 0)) as held:
        port = held.getsockname()[1]
        with pytest.raises(PortUnavailable, match=f"^--metrics-port {port} is --port's port too"):
            check_listen_ports("127.0.0.1", {"--port": port, "--metrics-port": port})


@pytest.mark.parametrize("host", ["no-such-host.invalid", "192.0.2.1"])
def test_a_host_that_is_not_here_is_refused_even_with_port_zero(host: str) -> None:
    with pytest.raises(PortUnavailable, match=f"^--host {host} is not an address this machine can listen on"):
        check_listen_ports(host, {"--port": 0})


@pytest.mark.parametrize("host", ["", "0.0.0.0", "localhost", "127.0.0.1"])
def test_hosts_as_grpc_spells_them_are_checked(host: str) -> None:
    check_listen_ports(host, {"--port": 0})
