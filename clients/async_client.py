"""asyncio client for the splitserve Generation service (grpc.aio); mirrors clients.Client."""

from __future__ import annotations

import logging
from collections.abc import AsyncIterator, Awaitable, Callable, Mapping, Sequence
from types import TracebackType
from typing import TypeVar, Unpack

import grpc
import grpc.aio
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


class AsyncDeltaStream(AsyncIterator[GenerationDelta]):
    """The deltas of one Generate call; the last one has finish_reason set."""

    def __init__(self, call: grpc.aio.UnaryStreamCall) -> None:
        self._call = call
        self._responses = call.__aiter__()

    def __aiter__(self) -> AsyncDeltaStream:
        return self

    async def __anext__(self) -> GenerationDelta:
        try:
            return delta_from_response(await self._responses.__anext__())
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

    async def __aenter__(self) -> AsyncDeltaStream:
        return self

    async def __aexit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        traceback: TracebackType | None,
    ) -> None:
        self.cancel()


class AsyncClient:
    """One grpc.aio channel to a scheduler service; create and use it inside one event loop.

    Arguments as for clients.Client. Each call also takes `api_key`, which replaces the client's
    own for that call only, so one channel can serve callers with keys of their own (the
    OpenAI-compatible gateway forwards each HTTP caller's bearer token this way).
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
            self._channel = grpc.aio.insecure_channel(address)
        else:
            self._channel = grpc.aio.secure_channel(address, credentials)
        self._stub = pb_grpc.GenerationStub(self._channel)
        self._health = health_pb2_grpc.HealthStub(self._channel)

    async def __aenter__(self) -> AsyncClient:
        return self

    async def __aexit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        traceback: TracebackType | None,
    ) -> None:
        await self.close()

    async def close(self) -> None:
        await self._channel.close()

    async def generate(
        self,
        prompt: str | None = None,
        *,
        prompt_token_ids: Sequence[int] | None = None,
        messages: Sequence[ChatMessage] | None = None,
        api_key: str | None = None,
        **options: Unpack[GenerateOptions],
    ) -> GenerationResult:
        """Runs one request to the end and returns its whole output; cancelling the coroutine
        cancels the call, so the server aborts the request at once."""
        assembler = ResultAssembler(want_logprobs=options.get("logprobs") is not None)
        stream = self.stream(
            prompt, prompt_token_ids=prompt_token_ids, messages=messages, api_key=api_key, **options
        )
        async with stream:
            async for delta in stream:
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
    ) -> AsyncDeltaStream:
        """Starts one request; async-iterate the result for its output as it is generated.

        Bad arguments raise ValueError here. Leaving the loop early cancels the call, so the
        server aborts the request and frees its memory: at once under `async with`, else when
        the stream is dropped. trace_context: W3C `traceparent` (and `tracestate`) sent with
        this call, so a tracing server's spans continue the caller's trace.
        """
        request = build_generate_request(
            prompt, prompt_token_ids=prompt_token_ids, messages=messages, **options
        )
        metadata = self._metadata(api_key, trace_context)
        call = self._stub.Generate(request, timeout=self._timeout, metadata=metadata)
        return AsyncDeltaStream(call)

    async def abort(self, request_id: str, *, api_key: str | None = None) -> bool:
        """Aborts a request by id; False when none with that id was in flight."""
        request = pb.AbortRequest(request_id=request_id)
        return (await self._unary(self._stub.Abort, request, api_key)).found

    async def tokenize(
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
        return tokenize_result(await self._unary(self._stub.Tokenize, request, api_key))

    async def detokenize(
        self, token_ids: Sequence[int], *, skip_special_tokens: bool = False, api_key: str | None = None
    ) -> str:
        """The text of token ids (special tokens included unless skip_special_tokens)."""
        request = build_detokenize_request(token_ids, skip_special_tokens)
        return (await self._unary(self._stub.Detokenize, request, api_key)).text

    async def model_info(self, *, api_key: str | None = None) -> pb.ModelInfo:
        return await self._unary(self._stub.GetModelInfo, pb.GetModelInfoRequest(), api_key)

    async def server_status(self, *, api_key: str | None = None) -> pb.ServerStatus:
        request = pb.GetServerStatusRequest()
        return await self._unary(self._stub.GetServerStatus, request, api_key)

    async def serving(self, *, timeout: float | None = None) -> bool:
        """Whether the server reports SERVING on grpc.health.v1 (which needs no API key).

        timeout replaces the client's for this probe: a health check must answer quickly even
        when generation calls may run without a deadline.
        """
        try:
            response = await self._health.Check(
                health_pb2.HealthCheckRequest(), timeout=self._timeout if timeout is None else timeout
            )
        except grpc.RpcError as error:
            raise SplitserveError.from_rpc_error(error) from None
        return response.status == health_pb2.HealthCheckResponse.SERVING

    async def _unary(
        self, method: Callable[..., Awaitable[Resp]], request: Req, api_key: str | None
    ) -> Resp:
        metadata = self._metadata(api_key)
        try:
            return await method(request, timeout=self._timeout, metadata=metadata)
        except grpc.RpcError as error:
            raise SplitserveError.from_rpc_error(error) from None
