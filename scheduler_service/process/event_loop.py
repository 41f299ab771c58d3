"""The event loop the scheduler's processes run on: asyncio's own (the default), or uvloop
(libuv's loop), which costs the front-ends ~17 % less CPU per token delivered (bench.scale,
2 x 256 at 40 ms, two front-ends, paired runs: 48.7-49.0 against 40.0-40.9 us per token). It is
not the default yet: the end-to-end suites passed on it, but one run of four tier and failover
test files failed once, unexplained, in five tries (none in three on asyncio's loop)."""

import asyncio
import importlib.util
import logging
from collections.abc import Callable, Coroutine
from typing import Any

logger = logging.getLogger(__name__)

EVENT_LOOPS = ("auto", "uvloop", "asyncio")


def event_loop_runner(choice: str) -> Callable[[Coroutine[Any, Any, Any]], Any]:
    """What runs the process's main coroutine: uvloop.run or asyncio.run (auto: uvloop when
    installed). ValueError when uvloop is asked for and not installed."""
    installed = importlib.util.find_spec("uvloop") is not None
    if choice == "uvloop" and not installed:
        raise ValueError("--event-loop uvloop: uvloop is not installed (pip install uvloop, or --event-loop asyncio)")
    use_uvloop = installed and choice != "asyncio"
    logger.info("event=event_loop loop=%s asked=%s", "uvloop" if use_uvloop else "asyncio", choice)
    if use_uvloop:
        import uvloop

        return uvloop.run
    return asyncio.run
