"""Every unary call a client makes, defined once: its parameters, its request and what the caller
gets back from the response. The blocking Client and the asyncio AsyncClient run the same calls
two ways; their methods are made from these definitions (`blocking`, `awaitable`, and for the
Generate stream `streaming` and `collected`), so the two cannot drift apart in parameters,
defaults or documentation (tests/clients/test_clients.py checks)."""

from __future__ import annotations

import functools
import inspect
import logging
from collections.abc import Callable, Coroutine, Mapping, Sequence
from dataclasses import dataclass
from typing import Any, Concatenate, Generic, ParamSpec, TypeVar, Unpack

from google.protobuf.message import Message
from grpc_health.v1 import health_pb2

from clients.chat_tools import ToolSpec
from clients.request_builder import (
    ChatMessage,
    GenerateOptions,
    TemplateValue,
    build_detokenize_request,
    build_generate_request,
    build_tokenize_request,
)
from clients.results import (
    GenerationResult,
    ResultAssembler,
    TokenizeResult,
    tokenize_result,
)
from protos.splitserve.v1 import generation_pb2 as pb

logger = logging.getLogger(__name__)

P = ParamSpec("P")
Out = TypeVar("Out")


@dataclass(slots=True, frozen=True)
class UnaryCall(Generic[Out]):
    """One unary RPC, ready to send: the service's stub method by name, the request, and how the
    response becomes what the caller gets."""

    method: str
    request: Message
    finish: Callable[[Any], Out]
    # Replaces the client's API key for this call only.
    api_key: str | None = None
    # grpc.health.v1 rather than the Generation service; it needs no API key, so none is sent.
    health: bool = False
    # Replaces the client's deadline for this call only.
    timeout: float | None = None


def blocking(define: Callable[P, UnaryCall[Out]]) -> Callable[Concatenate[Any, P], Out]:
    """A Client method running the call `define` makes (its parameters and docstring)."""

    def method(self: Any, *args: P.args, **kwargs: P.kwargs) -> Out:
        return self._run(define(*args, **kwargs))

    return _described(method, define, _unary_result(define))


def awaitable(define: Callable[P, UnaryCall[Out]]) -> Callable[Concatenate[Any, P], Coroutine[Any, Any, Out]]:
    """An AsyncClient coroutine method running the call `define` makes."""

    async def method(self: Any, *args: P.args, **kwargs: P.kwargs) -> Out:
        return await self._run(define(*args, **kwargs))

    return _described(method, define, _unary_result(define))


def streaming(define: Callable[P, GenerateCall], returns: str) -> Callable[Concatenate[Any, P], Any]:
    """A method starting the Generate call `define` makes, through the client's `_open`, which
    returns the client's kind of delta stream (named by `returns`)."""

    def method(self: Any, *args: P.args, **kwargs: P.kwargs) -> Any:
        return self._open(define(*args, **kwargs))

    return _described(method, define, returns)


def collected(define: Callable[P, GenerateCall]) -> Callable[Concatenate[Any, P], GenerationResult]:
    """A Client method running the Generate call `define` makes to the end."""

    def method(self: Any, *args: P.args, **kwargs: P.kwargs) -> GenerationResult:
        call = define(*args, **kwargs)
        assembler = ResultAssembler(call.want_logprobs, call.want_prompt_logprobs)
        for delta in self._open(call):
            assembler.add(delta)
        return assembler.result()

    return _described(method, define, "GenerationResult", COLLECTED_DOC)


def collected_awaitable(
    define: Callable[P, GenerateCall],
) -> Callable[Concatenate[Any, P], Coroutine[Any, Any, GenerationResult]]:
    """An AsyncClient coroutine method running the Generate call `define` makes to the end;
    cancelling the coroutine cancels the call, so the server aborts the request at once."""

    async def method(self: Any, *args: P.args, **kwargs: P.kwargs) -> GenerationResult:
        call = define(*args, **kwargs)
        assembler = ResultAssembler(call.want_logprobs, call.want_prompt_logprobs)
        async with self._open(call) as stream:
            async for delta in stream:
                assembler.add(delta)
        return assembler.result()

    return _described(method, define, "GenerationResult", COLLECTED_DOC)


COLLECTED_DOC = "Runs one request to the end and returns its whole output; arguments as for stream()."


def _described(method: Callable[..., Any], define: Callable[..., Any], returns: str, doc: str | None = None) -> Any:
    """method, named and documented as define, with define's parameters (self first) and
    `returns` as its result, for help() and inspect.signature."""
    functools.update_wrapper(method, define, updated=())
    del method.__wrapped__
    signature = inspect.signature(define)
    self_parameter = inspect.Parameter("self", inspect.Parameter.POSITIONAL_OR_KEYWORD)
    method.__signature__ = signature.replace(  # type: ignore[attr-defined]
        parameters=[self_parameter, *signature.parameters.values()], return_annotation=returns
    )
    if doc is not None:
        method.__doc__ = doc
    return method


def _unary_result(define: Callable[..., Any]) -> str:
    """What the caller gets from define's call: the X of its `UnaryCall[X]` annotation (a string
    under postponed annotations)."""
    return str(define.__annotations__["return"]).removeprefix("UnaryCall[").removesuffix("]")


class CancellingStream:
    """The handle of a Generate call: cancelling it aborts the request on the server, and one
    dropped before its end cancels itself (grpc frees, and so cancels, an abandoned call only
    when its reference cycles are collected; a loop left early must abort the request at once)."""

    def __init__(self, call: Any) -> None:
        self._call = call

    def __del__(self) -> None:
        self.cancel()

    def cancel(self) -> bool:
        """Cancels the call (the server aborts the request); False if it had already ended."""
        cancelled = bool(self._call.cancel())
        if cancelled:
            logger.debug("cancelled a Generate call")
        return cancelled


@dataclass(slots=True, frozen=True)
class GenerateCall:
    """One Generate stream, ready to start."""

    request: pb.GenerateRequest
    want_logprobs: bool
    api_key: str | None = None
    trace_context: Mapping[str, str] | None = None
    want_prompt_logprobs: bool = False
    # Replaces the client's tenant for this call only.
    tenant: str | None = None


def generate(
    prompt: str | None = None,
    *,
    prompt_token_ids: Sequence[int] | None = None,
    messages: Sequence[ChatMessage] | None = None,
    api_key: str | None = None,
    trace_context: Mapping[str, str] | None = None,
    tenant: str | None = None,
    **options: Unpack[GenerateOptions],
) -> GenerateCall:
    """Starts one request; iterate the result for its output as it is generated.

    Bad arguments raise ValueError here. Leaving the loop early cancels the call, so the server
    aborts the request and frees its memory: at once under `with` (`async with`), else when the
    stream is dropped. trace_context: W3C `traceparent` (and `tracestate`) sent with this call,
    so a tracing server's spans continue the caller's trace. tenant: whose request it is, in
    place of the client's (see Client). A request the server refuses for now (over its tenant's
    quota, or predicted to miss its ttft_deadline_ms or tpot_target_ms) raises SplitserveError
    with code RESOURCE_EXHAUSTED and retry_after_s, the seconds the server asks it to wait.
    """
    request = build_generate_request(prompt, prompt_token_ids=prompt_token_ids, messages=messages, **options)
    return GenerateCall(
        request,
        want_logprobs=options.get("logprobs") is not None,
        api_key=api_key,
        trace_context=trace_context,
        want_prompt_logprobs=options.get("prompt_logprobs") is not None,
        tenant=tenant,
    )


def abort(request_id: str, *, api_key: str | None = None) -> UnaryCall[bool]:
    """Aborts a request by id; False when none with that id was in flight."""
    return UnaryCall("Abort", pb.AbortRequest(request_id=request_id), _found, api_key)


def tokenize(
    text: str | None = None,
    messages: Sequence[ChatMessage] | None = None,
    *,
    add_generation_prompt: bool = True,
    chat_template_kwargs: Mapping[str, TemplateValue] | None = None,
    tools: Sequence[ToolSpec] | None = None,
    api_key: str | None = None,
) -> UnaryCall[TokenizeResult]:
    """The token ids Generate would use for text or a chat (rendered with the template, given
    chat_template_kwargs as extra variables and tools as Generate renders them)."""
    request = build_tokenize_request(text, messages, add_generation_prompt, chat_template_kwargs, tools)
    return UnaryCall("Tokenize", request, tokenize_result, api_key)


def detokenize(
    token_ids: Sequence[int], *, skip_special_tokens: bool = False, api_key: str | None = None
) -> UnaryCall[str]:
    """The text of token ids (special tokens included unless skip_special_tokens)."""
    return UnaryCall("Detokenize", build_detokenize_request(token_ids, skip_special_tokens), _text, api_key)


def model_info(*, api_key: str | None = None) -> UnaryCall[pb.ModelInfo]:
    """What the server serves: the model, its vocabulary and limits."""
    return UnaryCall("GetModelInfo", pb.GetModelInfoRequest(), _itself, api_key)


def server_status(*, api_key: str | None = None) -> UnaryCall[pb.ServerStatus]:
    """The server's queues, executors and KV use."""
    return UnaryCall("GetServerStatus", pb.GetServerStatusRequest(), _itself, api_key)


def serving(*, timeout: float | None = None) -> UnaryCall[bool]:
    """Whether the server reports SERVING on grpc.health.v1 (which needs no API key).

    timeout replaces the client's for this probe: a health check must answer quickly even when
    generation calls may run without a deadline.
    """
    return UnaryCall("Check", health_pb2.HealthCheckRequest(), _is_serving, health=True, timeout=timeout)


def _found(response: pb.AbortResponse) -> bool:
    return response.found


def _text(response: pb.DetokenizeResponse) -> str:
    return response.text


def _itself(response: Out) -> Out:
    return response


def _is_serving(response: health_pb2.HealthCheckResponse) -> bool:
    return response.status == health_pb2.HealthCheckResponse.SERVING

