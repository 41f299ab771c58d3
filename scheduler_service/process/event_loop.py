"""The event loop the scheduler's processes run on: uvloop (libuv's loop) where it is installed,
as it is with the package (auto, the default), or asyncio's own. uvloop costs the front-ends
~17 % less CPU per token delivered (bench.scale, 2 x 256 at 40 ms, two front-ends, paired runs
on two days: 48.7-49.0 against 40.0-40.9 us per token, then 55.4-56.3 against 44.0-48.2). The
tier test failures that kept it opt-in at first were the tests' own race (a fault struck after
the streams it was to interrupt had ended, which uvloop's faster front-ends made likelier), not
the loop's."""

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
