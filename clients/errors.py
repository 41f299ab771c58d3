"""The one exception the client library raises for failed calls."""

from __future__ import annotations

import math
from collections.abc import Iterable

import grpc

# Trailing metadata of a refused call (an overloaded scheduler, a tenant over its quota, a
# deadline predicted to be missed): whole seconds after which the call may succeed.
RETRY_AFTER_METADATA = "retry-after"


class SplitserveError(Exception):
    """A call to the server failed; carries the gRPC status code and the server's message.

    retry_after_s: when the server refused the call for now (RESOURCE_EXHAUSTED with its
    `retry-after` metadata), the seconds to wait before trying again; None otherwise.
    """

    def __init__(self, code: grpc.StatusCode, details: str, retry_after_s: float | None = None) -> None:
        super().__init__(f"{code.name}: {details}")
        self.code = code
        self.details = details
        self.retry_after_s = retry_after_s

    @classmethod
    def from_rpc_error(cls, error: grpc.RpcError) -> SplitserveError:
        # Both sync and asyncio call errors implement grpc.Call's code(), details() and
        # trailing_metadata().
        code = error.code() if hasattr(error, "code") else grpc.StatusCode.UNKNOWN
        details = error.details() if hasattr(error, "details") else str(error)
        trailing = error.trailing_metadata() if hasattr(error, "trailing_metadata") else None
        return cls(code or grpc.StatusCode.UNKNOWN, details or "", retry_after(trailing or ()))


def retry_after(metadata: Iterable[tuple[str, str | bytes]]) -> float | None:
    """The `retry-after` seconds in a call's trailing metadata; None when it has none, or one
    that is not a number of seconds (a hint, never a reason to fail differently)."""
    for key, value in metadata:
        if key != RETRY_AFTER_METADATA:
            continue
        text = value.decode(errors="replace") if isinstance(value, bytes) else value
        try:
            seconds = float(text)
        except ValueError:
            return None
        return seconds if math.isfinite(seconds) and seconds >= 0 else None
    return None
