"""The executors' shared token for tests: one file per test process, which the executor and
scheduler starters pass to both sides (executors are closed by default), and a channel wrapper
that sends it on every call, as the scheduler does."""

from __future__ import annotations

import collections
import contextlib
import functools
import tempfile
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import grpc

from protos.executor_access import EXECUTOR_TOKEN_METADATA, read_token_file, write_token_file


@functools.cache
def token_file() -> Path:
    """A token file only this user can read, made once per process."""
    path = Path(tempfile.mkdtemp(prefix="splitserve-test-token-")) / "executor-token"
    write_token_file(path)
    return path


def token() -> str:
    return read_token_file(token_file())


class _CallDetails(
    collections.namedtuple("_CallDetails", ("method", "timeout", "metadata", "credentials", "wait_for_ready", "compression")),
    grpc.ClientCallDetails,
):
    pass


class _TokenInterceptor(
    grpc.UnaryUnaryClientInterceptor,
    grpc.UnaryStreamClientInterceptor,
    grpc.StreamUnaryClientInterceptor,
    grpc.StreamStreamClientInterceptor,
):
    def __init__(self, value: str) -> None:
        self._value = value

    def _with_token(self, details: grpc.ClientCallDetails) -> grpc.ClientCallDetails:
        metadata = [*(details.metadata or ()), (EXECUTOR_TOKEN_METADATA, self._value)]
        return _CallDetails(
            details.method, details.timeout, metadata, details.credentials,
            details.wait_for_ready, details.compression,
        )

    def _call(self, continuation: Callable[..., Any], details: grpc.ClientCallDetails, request: Any) -> Any:
        return continuation(self._with_token(details), request)

    intercept_unary_unary = _call
    intercept_unary_stream = _call
    intercept_stream_unary = _call
    intercept_stream_stream = _call


def with_token(channel: grpc.Channel, value: str | None = None) -> grpc.Channel:
    """channel, sending the executors' token (this process's, unless value) on every call."""
    return grpc.intercept_channel(channel, _TokenInterceptor(value if value is not None else token()))


@contextlib.contextmanager
def token_channel(address: str) -> Iterator[grpc.Channel]:
    """A plaintext channel to a test executor that sends this process's token on every call."""
    with grpc.insecure_channel(address) as channel:
        yield with_token(channel)
