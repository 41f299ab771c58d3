"""The ports the services listen on when none is given: one home for the services, the launcher
and whatever dials them, so a flag left out on both sides still meets."""

from __future__ import annotations

DEFAULT_SCHEDULER_PORT = 50051
DEFAULT_EXECUTOR_PORT = 50052
# Where a scheduler started without --executor looks: an executor started without --port on the
# same machine.
DEFAULT_EXECUTOR_ADDRESS = f"127.0.0.1:{DEFAULT_EXECUTOR_PORT}"
