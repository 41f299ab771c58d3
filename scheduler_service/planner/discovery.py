"""Executor addresses as given on the command line: HOST:PORT as is, or dns:///NAME:PORT,
resolved at start and every interval after, so the pods behind a Kubernetes headless Service
are found as they come and go (a name's address that disappears is drained, then removed)."""

import asyncio
import logging
import socket
from collections.abc import Sequence

from scheduler_service.planner.engine import Engine

logger = logging.getLogger(__name__)

DNS_PREFIX = "dns:///"
DEFAULT_RESOLVE_INTERVAL_S = 10.0


def split_target(target: str) -> tuple[str, int]:
    """(name, port) of a dns:/// target."""
    name, _, port = target.removeprefix(DNS_PREFIX).rpartition(":")
    if not name or not port.isdigit():
        raise ValueError(f"{target!r} is not dns:///NAME:PORT")
    return name, int(port)


async def resolve(target: str) -> set[str]:
    """The HOST:PORT addresses a dns:/// target names now."""
    name, port = split_target(target)
    infos = await asyncio.get_running_loop().getaddrinfo(name, port, type=socket.SOCK_STREAM)
    addresses = set()
    for family, _, _, _, sockaddr in infos:
        host = sockaddr[0]
        addresses.add(f"[{host}]:{port}" if family == socket.AF_INET6 else f"{host}:{port}")
    return addresses


async def discover(engine: Engine, targets: Sequence[str], interval_s: float) -> None:
    """Adds the fixed executors, then keeps the resolved ones current until cancelled."""
    names = [t for t in targets if t.startswith(DNS_PREFIX)]
    for target in targets:
        if not target.startswith(DNS_PREFIX):
            engine.add_executor(target)
    current: dict[str, set[str]] = {name: set() for name in names}
    while names:
        for name in names:
            try:
                found = await resolve(name)
            except OSError as error:
                # A lookup that fails keeps what was found before: executors are not dropped
                # for a DNS hiccup.
                logger.warning("event=resolve_failed target=%s error=%r", name, error)
                continue
            for address in sorted(found - current[name]):
                engine.add_executor(address)
            for address in sorted(current[name] - found):
                engine.remove_executor(address)
            if found != current[name]:
                logger.info("event=executors_resolved target=%s addresses=%s", name, sorted(found))
            current[name] = found
        await asyncio.sleep(interval_s)
