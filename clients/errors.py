"""The one exception the client library raises for failed calls."""

from __future__ import annotations

import grpc


class SplitserveError(Exception):
    """A call to the server failed; carries the gRPC status code and the server's message."""

    def __init__(self, code: grpc.StatusCode, details: str) -> None:
        super().__init__(f"{code.name}: {details}")
        self.code = code
        self.details = details

    @classmethod
    def from_rpc_error(cls, error: grpc.RpcError) -> SplitserveError:
        # Both sync and asyncio call errors implement grpc.Call's code() and details().
        code = error.code() if hasattr(error, "code") else grpc.StatusCode.UNKNOWN
        details = error.details() if hasattr(error, "details") else str(error)
        return cls(code or grpc.StatusCode.UNKNOWN, details or "")
