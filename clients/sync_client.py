"""Blocking client for the splitserve Generation service."""

from __future__ import annotations

from collections.abc import Iterator
from types import TracebackType
from typing import Protocol, TypeVar

import grpc

from clients import calls
from clients.calls import (
    CancellingStream,
    UnaryCall,
    blocking,
    collected,
    streaming,
)
from clients.connection import ChannelClient
from clients.errors import SplitserveError
from clients.results import GenerationDelta, delta_from_response
from protos.splitserve.v1 import generation_pb2 as pb

Out = TypeVar("Out")


class StreamingCall(Protocol):
    """What grpc returns for a server-streaming call, as far as DeltaStream uses it."""

    def __next__(self) -> pb.GenerateResponse: ...

    def cancel(self) -> bool: ...


class DeltaStream(CancellingStream, Iterator[GenerationDelta]):
    """The deltas of one Generate call; the last one has finish_reason set."""

    def __init__(self, call: StreamingCall) -> None:
        super().__init__(call)

    def __iter__(self) -> DeltaStream:
        return self

    def __next__(self) -> GenerationDelta:
        try:
            return delta_from_response(next(self._call))
        except grpc.RpcError as error:
            raise SplitserveError.from_rpc_error(error) from None

    def __enter__(self) -> DeltaStream:
        return self

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        traceback: TracebackType | None,
    ) -> None:
        self.cancel()


class Client(ChannelClient):
    """One channel to a scheduler service; safe to share between threads.

    timeout: deadline in seconds for each call (for a Generate stream: the whole stream).
    api_key: sent as 'authorization: Bearer KEY' with every call (servers started with
        --api-key-file need it).
    root_certificates: PEM bytes of the CA that signed the server's certificate; connects over
        TLS. tls=True connects over TLS trusting the system's root certificates.
    credentials: any grpc.ChannelCredentials instead (not with root_certificates).
    metadata: (key, value) pairs sent with every call.
    tenant: whose requests these are, sent as 'x-splitserve-tenant' metadata; a scheduler takes
        it where it has no API keys (behind a gateway that authenticates) or for a key its key
        file marks `*`, and otherwise counts each request for its key's tenant.

    Each call also takes `api_key`, which replaces the client's own for that call only, and
    generate()/stream() take `trace_context` (W3C traceparent, tracestate) and `tenant` for that
    request. A request the server refuses for now raises SplitserveError with retry_after_s set.
    """

    _transport = grpc
    _stream_type = DeltaStream

    def __enter__(self) -> Client:
        return self

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        traceback: TracebackType | None,
    ) -> None:
        self.close()

    def close(self) -> None:
        self._channel.channel.close()

    stream = streaming(calls.generate, "DeltaStream")
    generate = collected(calls.generate)
    abort = blocking(calls.abort)
    tokenize = blocking(calls.tokenize)
    detokenize = blocking(calls.detokenize)
    model_info = blocking(calls.model_info)
    server_status = blocking(calls.server_status)
    serving = blocking(calls.serving)

    def _run(self, call: UnaryCall[Out]) -> Out:
        method, options = self._channel.unary(call)
        try:
            return call.finish(method(call.request, **options))
        except grpc.RpcError as error:
            raise SplitserveError.from_rpc_error(error) from None
