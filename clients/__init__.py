"""Python client library for splitserve: `Client` (blocking) and `AsyncClient` (asyncio)."""

from clients.async_client import AsyncClient, AsyncDeltaStream
from clients.errors import SplitserveError
from clients.results import (
    GenerationDelta,
    GenerationResult,
    Timings,
    TokenizeResult,
    TokenLogprob,
    Usage,
)
from clients.sync_client import Client, DeltaStream

__all__ = [
    "AsyncClient",
    "AsyncDeltaStream",
    "Client",
    "DeltaStream",
    "GenerationDelta",
    "GenerationResult",
    "SplitserveError",
    "Timings",
    "TokenLogprob",
    "TokenizeResult",
    "Usage",
]
