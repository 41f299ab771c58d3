"""A scheduler engine run in the test's own event loop against one real executor, over a link
class the test chooses (to record or tamper with what crosses the wire)."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from typing import TypeVar

from scheduler_service.planner.engine import Engine
from scheduler_service.planner.engine_options import EngineOptions
from scheduler_service.planner.executor_link import ExecutorLink
from scheduler_service.planner.metrics import SchedulerMetrics
from tests.helpers.executor_token import token

LinkT = TypeVar("LinkT", bound=ExecutorLink)


@asynccontextmanager
async def engine_over(
    address: str, link_type: type[LinkT], options: EngineOptions | None = None
) -> AsyncIterator[tuple[Engine, list[LinkT]]]:
    """Yields the serving engine and the links it made (one per connection); stops it on exit."""
    links: list[LinkT] = []

    def make_link(address: str, scheduler_id: str) -> LinkT:
        # With the executors' token, as the test executors are closed by default.
        links.append(link_type(address, scheduler_id, token=token()))
        return links[-1]

    engine = Engine("test", None, options or EngineOptions(), SchedulerMetrics(), link_factory=make_link)
    engine.add_executor(address)
    await engine.wait_until_serving()
    runner = asyncio.create_task(engine.run())
    try:
        yield engine, links
    finally:
        runner.cancel()
        await engine.close()
