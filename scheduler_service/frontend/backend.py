"""What the client-facing services (servicer.py) need of whoever plans their requests: the
engine in this process (engine.Engine), or a planner reached over the Planner API from a
front-end (tier/planner_client.py)."""

from collections.abc import Mapping
from typing import Protocol

from protos.splitserve.executor.v1 import executor_pb2
from protos.splitserve.v1 import generation_pb2 as pb
from scheduler_service.core.request import Request
from scheduler_service.frontend.output_stream import OutputStream
from scheduler_service.text.tokenizer import TextProcessor


class Backend(Protocol):
    text: TextProcessor | None

    @property
    def info(self) -> executor_pb2.ExecutorInfo | None:
        """The model, once an executor was reached."""
        ...

    @property
    def draining(self) -> bool:
        """Set on shutdown: new requests are refused while those in flight finish."""
        ...

    @property
    def wants_trace_context(self) -> bool:
        """Whether a caller's W3C trace context should come with its request."""
        ...

    def why_no_executor(self) -> str:
        ...

    def open_stream(self, request: Request, trace_carrier: Mapping[str, str] | None = None) -> OutputStream:
        """Queues the request; its client reads the returned stream. RequestRejected says why
        it cannot run."""
        ...

    def cancel(self, stream: OutputStream) -> bool:
        """Ends the request of this stream, if it still runs."""
        ...

    async def abort_request(self, request_id: str) -> bool:
        """Ends the request with this client id, wherever it runs; whether one was found.
        RequestRejected when whoever runs it could not be asked."""
        ...

    async def server_status(self) -> pb.ServerStatus:
        """RequestRejected when whoever holds the status could not be asked."""
        ...
