"""Starts a real OpenAI-compatible gateway process (python -m clients.openai_gateway) for tests.

    from tests.helpers.gateway_process import start_gateway
    with start_gateway(scheduler_address, served_model_name="tiny") as address:
        client = openai.OpenAI(base_url=f"http://{address}/v1", api_key=KEY)

Flags are the CLI's, with underscores. The gateway binds port 0; the address comes from its ready
log line.
"""

from __future__ import annotations

import re
import sys
from collections.abc import Iterator
from contextlib import contextmanager

from tests.helpers.service_process import ServiceProcess, cli_flags

READY_PATTERN = re.compile(r"event=gateway_ready address=(\S+):(\d+)")


def gateway_command(scheduler: str, **flags: object) -> list[str]:
    command = [sys.executable, "-m", "clients.openai_gateway", "--port", "0", "--server", scheduler]
    return command + cli_flags(flags)


class GatewayProcess(ServiceProcess):
    def __init__(self, scheduler: str, **flags: object) -> None:
        super().__init__(gateway_command(scheduler, **flags), READY_PATTERN, "gateway")


@contextmanager
def start_gateway(scheduler: str, **flags: object) -> Iterator[str]:
    """Yields HOST:PORT once the gateway listens; it is stopped on exit."""
    gateway = GatewayProcess(scheduler, **flags)
    try:
        yield gateway.wait_ready(timeout_s=60.0)
    finally:
        gateway.close()
