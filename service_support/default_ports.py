"""The ports the services listen on when none is given: one home for the services, the launcher
and whatever dials them, so a flag left out on both sides still meets."""

from __future__ import annotations

DEFAULT_SCHEDULER_PORT = 50051
DEFAULT_EXECUTOR_PORT = 50052
# Where a scheduler started without --executor looks: an executor started without --port on the
# same machine.
DEFAULT_EXECUTOR_ADDRESS = f"127.0.0.1:{DEFAULT_EXECUTOR_PORT}"
# Where clients (the CLI, the gateway) dial a scheduler started without --port on this machine.
DEFAULT_SCHEDULER_ADDRESS = f"127.0.0.1:{DEFAULT_SCHEDULER_PORT}"
# The OpenAI-compatible gateway's HTTP port (vLLM's and most OpenAI-compatible servers' 8000).
DEFAULT_GATEWAY_PORT = 8000
