"""Blocking client for the splitserve Generation service."""

from __future__ import annotations

import logging
from collections.abc import Callable, Iterator, Mapping, Sequence
from types import TracebackType
from typing import Protocol, TypeVar, Unpack

import grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc

from clients.connection import CallMetadata, Metadata, channel_credentials
from clients.errors import SplitserveError
from clients.request_builder import (
    ChatMessage,
    GenerateOptions,
    TemplateValue,
    build_detokenize_request,
    build_generate_request,
    build_tokenize_request,
)
from clients.results import (
    GenerationDelta,
    GenerationResult,
    ResultAssembler,
    TokenizeResult,
    delta_from_response,
    tokenize_result,
)
from protos.splitserve.v1 import generation_pb2 as pb
from protos.splitserve.v1 import generation_pb2_grpc as pb_grpc

logger = logging.getLogger(__name__)

Req = TypeVar("Req")
Resp = TypeVar("Resp")


class StreamingCall(Protocol):
    """What grpc returns for a server-streaming call, as far as DeltaStream uses it."""

    def __next__(self) -> pb.GenerateResponse: ...

    def cancel(self) -> bool: ...


class DeltaStream(Iterator[GenerationDelta]):
    """The deltas of one Generate call; the last one has finish_reason set."""

    def __init__(self, call: StreamingCall) -> None:
        self._call = call

    def __iter__(self) -> DeltaStream:
        return self

    def __next__(self) -> GenerationDelta:
        try:
            return delta_from_response(next(self._call))
        except grpc.RpcError as error:
            raise SplitserveError.from_rpc_error(error) from None

    def __del__(self) -> None:
        # grpc frees (and so cancels) an abandoned call only when its reference cycles are
        # collected; a loop left early must abort the request on the server at once.
        self.cancel()

    def cancel(self) -> bool:
        """Cancels the call (the server aborts the request); False if it had already ended."""
        cancelled = self._call.cancel()
        if cancelled:
            logger.debug("cancelled a Generate call")
        return cancelled

    def __enter__(self) -> DeltaStream:
        return self

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        traceback: TracebackType | None,
    ) -> None:
        self.cancel()


class Client:
    """One channel to a scheduler service; safe to share between threads.

    timeout: deadline in seconds for each call (for a Generate stream: the whole stream).
    api_key: sent as 'authorization: Bearer KEY' with every call (servers started with
        --api-key-file need it).
    root_certificates: PEM bytes of the CA that signed the server's certificate; connects over
        TLS. tls=True connects over TLS trusting the system's root certificates.
    credentials: any grpc.ChannelCredentials instead (not with root_certificates).
    metadata: (key, value) pairs sent with every call.

    Each call also takes `api_key`, which replaces the client's own for that call only, and
    generate()/stream() take `trace_context` (W3C traceparent, tracestate) for that request.
    """

    def __init__(
        self,
        address: str,
        *,
        timeout: float | None = None,
        api_key: str | None = None,
        root_certificates: bytes | None = None,
        tls: bool = False,
        credentials: grpc.ChannelCredentials | None = None,
        metadata: Metadata | None = None,
    ) -> None:
        self._timeout = timeout
        self._metadata = CallMetadata(metadata, api_key)
        credentials = channel_credentials(credentials, root_certificates, tls)
        if credentials is None:
            self._channel = grpc.insecure_channel(address)
        else:
            self._channel = grpc.secure_channel(address, credentials)
        self._stub = pb_grpc.GenerationStub(self._channel)
        self._health = health_pb2_grpc.HealthStub(self._channel)

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
        self._channel.close()

    def generate(
        self,
        prompt: str | None = None,
        *,
        prompt_token_ids: Sequence[int] | None = None,
        messages: Sequence[ChatMessage] | None = None,
        api_key: str | None = None,
        trace_context: Mapping[str, str] | None = None,
        **options: Unpack[GenerateOptions],
    ) -> GenerationResult:
        """Runs one request to the end and returns its whole output."""
        assembler = ResultAssembler(want_logprobs=options.get("logprobs") is not None)
        for delta in self.stream(
            prompt,
            prompt_token_ids=prompt_token_ids,
            messages=messages,
            api_key=api_key,
            trace_context=trace_context,
            **options,
        ):
            assembler.add(delta)
        return assembler.result()

    def stream(
        self,
        prompt: str | None = None,
        *,
        prompt_token_ids: Sequence[int] | None = None,
        messages: Sequence[ChatMessage] | None = None,
        api_key: str | None = None,
        trace_context: Mapping[str, str] | None = None,
        **options: Unpack[GenerateOptions],
    ) -> DeltaStream:
        """Starts one request; iterate the result for its output as it is generated.

        Bad arguments raise ValueError here. Leaving the loop early cancels the call, so the
        server aborts the request and frees its memory: at once under `with`, else when the
        stream is dropped.
        """
        request = build_generate_request(
            prompt, prompt_token_ids=prompt_token_ids, messages=messages, **options
        )
        metadata = self._metadata(api_key, trace_context)
        call = self._stub.Generate(request, timeout=self._timeout, metadata=metadata)
        return DeltaStream(call)

    def abort(self, request_id: str, *, api_key: str | None = None) -> bool:
        """Aborts a request by id; False when none with that id was in flight."""
        return self._unary(self._stub.Abort, pb.AbortRequest(request_id=request_id), api_key).found

    def tokenize(
        self,
        text: str | None = None,
        messages: Sequence[ChatMessage] | None = None,
        *,
        add_generation_prompt: bool = True,
        chat_template_kwargs: Mapping[str, TemplateValue] | None = None,
        api_key: str | None = None,
    ) -> TokenizeResult:
        """The token ids Generate would use for text or a chat (rendered with the template, given
        chat_template_kwargs as extra variables)."""
        request = build_tokenize_request(text, messages, add_generation_prompt, chat_template_kwargs)
        return tokenize_result(self._unary(self._stub.Tokenize, request, api_key))

    def detokenize(
        self, token_ids: Sequence[int], *, skip_special_tokens: bool = False, api_key: str | None = None
    ) -> str:
        """The text of token ids (special tokens included unless skip_special_tokens)."""
        request = build_detokenize_request(token_ids, skip_special_tokens)
        return self._unary(self._stub.Detokenize, request, api_key).text

    def model_info(self, *, api_key: str | None = None) -> pb.ModelInfo:
        return self._unary(self._stub.GetModelInfo, pb.GetModelInfoRequest(), api_key)

    def server_status(self, *, api_key: str | None = None) -> pb.ServerStatus:
        return self._unary(self._stub.GetServerStatus, pb.GetServerStatusRequest(), api_key)

    def serving(self, *, timeout: float | None = None) -> bool:
        """Whether the server reports SERVING on grpc.health.v1 (which needs no API key);
        timeout replaces the client's for this probe."""
        try:
            response = self._health.Check(
                health_pb2.HealthCheckRequest(), timeout=self._timeout if timeout is None else timeout
            )
        except grpc.RpcError as error:
            raise SplitserveError.from_rpc_error(error) from None
        return response.status == health_pb2.HealthCheckResponse.SERVING

    def _unary(self, method: Callable[..., Resp], request: Req, api_key: str | None = None) -> Resp:
        try:
            return method(request, timeout=self._timeout, metadata=self._metadata(api_key))
        except grpc.RpcError as error:
            raise SplitserveError.from_rpc_error(error) from None
