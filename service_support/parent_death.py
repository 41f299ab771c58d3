"""A service started by splitserve's launcher or by the all-in-one scheduler ends with its
parent, even when the parent is killed with SIGKILL: the child asks Linux for SIGTERM when its
parent dies.

The child asks for itself, at start, rather than through a preexec_fn between fork and exec:
a preexec_fn makes subprocess fork the whole process (vfork and posix_spawn cannot run Python
code), and forking a process with gRPC threads runs gRPC's fork handlers, which log a plain-text
line into a --log-format json stream and are unsafe with other threads running."""

import ctypes
import logging
import os
import signal
import sys
from collections.abc import Mapping

logger = logging.getLogger(__name__)

# The parent's pid, given to the child in its environment.
PARENT_PID_ENV = "SPLITSERVE_PARENT_PID"
PR_SET_PDEATHSIG = 1


def child_environment(base: Mapping[str, str] | None = None) -> dict[str, str]:
    """base (this process's environment by default), naming this process as the parent a child
    must not outlive."""
    return {**(os.environ if base is None else base), PARENT_PID_ENV: str(os.getpid())}


def end_with_parent() -> None:
    """Where the environment names a parent: SIGTERM when it dies, and exit now if it already
    has (it died before the request was made, so no signal would come). The name is taken out
    of the environment, so that this process's own children do not read it as theirs."""
    parent = os.environ.pop(PARENT_PID_ENV, None)
    if parent is None or not sys.platform.startswith("linux"):
        return
    ctypes.CDLL(None, use_errno=True).prctl(PR_SET_PDEATHSIG, signal.SIGTERM)
    if os.getppid() != int(parent):
        logger.warning("event=parent_gone parent_pid=%s", parent)
        sys.exit(1)
