"""Entry point: python -m scheduler_service.launch (see the package docstring)."""

from __future__ import annotations

import logging
import signal
import sys
from collections.abc import Sequence

from scheduler_service.launch.children import ChildFailed, Shutdown
from scheduler_service.launch.launcher import Launcher
from scheduler_service.launch.options import parse_args
from service_support.port_check import PortUnavailable

# One logger for the whole launcher: its lines read logger=scheduler_service.launch whichever
# module wrote them (run with -m, this module's own __name__ is "__main__").
logger = logging.getLogger("scheduler_service.launch")


def serve_main(argv: Sequence[str] | None = None, prog: str = "splitserve serve") -> int:
    """`splitserve serve MODEL_DIR`: the user's model on the default ports, nothing asked."""
    return main(argv, prog, serve=True)


def main(
    argv: Sequence[str] | None = None, prog: str = "python -m scheduler_service.launch", serve: bool = False
) -> int:
    logging.basicConfig(
        level=logging.INFO,
        stream=sys.stderr,
        format="%(asctime)s level=%(levelname)s logger=%(name)s %(message)s",
    )
    launcher = Launcher(parse_args(argv, prog, serve))
    # Only a flag: the launcher acts on it at its next poll, never between two arbitrary lines.
    for signum in (signal.SIGINT, signal.SIGTERM):
        signal.signal(signum, lambda _signum, _frame: launcher.children.stop_requested.set())
    logger.info("event=launcher_starting log_dir=%s", launcher.options.log_dir)
    try:
        return launcher.run()
    except Shutdown:
        logger.info("event=shutdown_requested")
        return 0
    except PortUnavailable as taken:
        logger.error("event=port_unavailable problem=%r", str(taken))
        print(f"error: {taken}", file=sys.stderr)
        return 2
    except ChildFailed as failure:
        child = failure.child
        logger.error("event=child_failed problem=%r log=%s", str(failure), child.log_path)
        if launcher.options.verbose:
            tail = child.tail()
            if tail:
                print(f"--- last lines of {child.log_path} ---\n{tail}", file=sys.stderr)
        else:
            # The service's own one-line refusal says what is wrong and what to do.
            why = child.last_error()
            log = f" (its log: {child.log_path}; -v shows its last lines)" if child.log_path else ""
            print(f"error: {failure}{log}" + (f"\n  {why}" if why else ""), file=sys.stderr)
        return 1
    finally:
        launcher.children.stop_all()
        launcher.close()
        logger.info("event=launcher_stopped")


if __name__ == "__main__":
    sys.exit(main())
