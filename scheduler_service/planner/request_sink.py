"""Where the engine sends a request's tokens: its client's stream in this process
(frontend/output_stream.py: OutputStream), or the front-end that holds the client
(tier/frontend_link.py: RemoteSink)."""

from collections.abc import Sequence
from typing import Any, Protocol

from protos.splitserve.executor.v1 import executor_pb2
from scheduler_service.core.errors import RequestError
from scheduler_service.core.request import Request
from scheduler_service.text.detokenizer import StringStop


class RequestSink(Protocol):
    request: Request
    # Set once the request's end (close) or error (fail) went in; nothing follows.
    closed: bool
    error: RequestError | None
    # The request's span while tracing is on (frontend/tracing.py).
    trace_span: Any

    def add_tokens(
        self, token_ids: list[int], logprobs: Sequence[executor_pb2.TokenLogprob]
    ) -> tuple[Any, StringStop | None]:
        """The message carrying newly sampled tokens, and the stop string their text completed
        (None where stop strings are found elsewhere); with one, the message carries only the
        tokens up to the one that completed it."""
        ...

    def send(self, message: Any) -> None:
        """Passes on a message add_tokens made."""
        ...

    def close(self, message: Any = None) -> None:
        """The request ended (its finish reason is set): the last message, with its end."""
        ...

    def fail(self, error: RequestError) -> None:
        """The request failed: its end is this error."""
        ...
