"""The FastAPI application: the OpenAI-compatible routes over one shared AsyncClient (one gRPC
channel for every request; each call carries its caller's bearer token, and the tenant its
x-splitserve-tenant header names)."""

from __future__ import annotations

import logging
import time
import uuid
from collections.abc import AsyncIterator, Callable
from contextlib import asynccontextmanager
from dataclasses import dataclass
from typing import Any

from fastapi import APIRouter, FastAPI, Request
from fastapi.responses import JSONResponse, Response

from clients.async_client import AsyncClient
from clients.errors import SplitserveError
from clients.openai_gateway.body_limit import BodyLimit
from clients.openai_gateway.errors import (
    bad_request,
    from_splitserve,
    install_error_handlers,
)
from clients.openai_gateway.responses import (
    ChatShaper,
    ChoiceShapers,
    CompletionShaper,
    ResponseContext,
    Shaper,
)
from clients.openai_gateway.schemas import (
    ChatCompletionRequest,
    CompletionRequest,
    SamplingFields,
)
from clients.openai_gateway.served_model import ServedModel
from clients.openai_gateway.state import (
    ApiKey,
    Gateway,
    GatewayDep,
    GatewaySettings,
    Tenant,
)
from clients.openai_gateway.streaming import (
    ClientDisconnected,
    EventStreamResponse,
    collect,
    event_stream,
    first_delta,
)
from clients.openai_gateway.tokenization import router as tokenization_router
from clients.openai_gateway.tool_calls import parser_for
from clients.openai_gateway.translate import GenerateCall, chat_call, completion_call
from clients.results import TokenLogprob
from protos.splitserve.v1 import generation_pb2 as pb

logger = logging.getLogger(__name__)
TRACE_CONTEXT_HEADERS = ("traceparent", "tracestate")
# W3C's limit for tracestate, and far above any traceparent.
MAX_TRACE_HEADER_CHARS = 512

# nginx's code for "the client closed the connection": nobody receives it, but logs show it.
CLIENT_CLOSED_REQUEST = 499


@dataclass(slots=True, frozen=True)
class Caller:
    """Who a Generate call is for: the caller's bearer token and the tenant it names (auth.py)."""

    api_key: str | None
    tenant: str | None


def create_app(settings: GatewaySettings) -> FastAPI:
    @asynccontextmanager
    async def lifespan(app: FastAPI) -> AsyncIterator[None]:
        # A grpc.aio channel belongs to the event loop that made it: the server's, so here.
        async with AsyncClient(
            settings.server, root_certificates=settings.root_certificates, tls=settings.tls
        ) as client:
            model = ServedModel(client, settings.served_model_name)
            app.state.gateway = Gateway(client, model, settings, int(time.time()))
            yield

    app = FastAPI(title="splitserve OpenAI-compatible gateway", lifespan=lifespan)
    app.add_middleware(
        BodyLimit,
        max_bytes=settings.max_body_bytes,
        max_bytes_in_flight=settings.max_body_bytes_in_flight,
        read_timeout_s=settings.body_read_timeout_s,
    )
    install_error_handlers(app)
    app.include_router(router)
    app.include_router(tokenization_router)
    return app


router = APIRouter()


@router.post("/v1/completions")
async def completions(
    body: CompletionRequest, request: Request, gateway: GatewayDep, api_key: ApiKey, tenant: Tenant
) -> Response:
    request_id = f"cmpl-{uuid.uuid4().hex}"
    call = completion_call(body, request_id)
    context = await _context(gateway, body, api_key, request_id, body.logprobs is not None)
    caller = Caller(api_key, tenant)
    if body.echo:
        # One choice (translate.py refuses echo beside n > 1).
        echoing = CompletionShaper(context)
        await _echo(gateway, call, api_key, echoing)
        return await _respond(request, gateway, call, caller, echoing, bool(body.stream))
    shaper = _per_choice(lambda: CompletionShaper(context), body.n)
    return await _respond(request, gateway, call, caller, shaper, bool(body.stream), body.n or 1)


@router.post("/v1/chat/completions")
async def chat_completions(
    body: ChatCompletionRequest, request: Request, gateway: GatewayDep, api_key: ApiKey, tenant: Tenant
) -> Response:
    request_id = f"chatcmpl-{uuid.uuid4().hex}"
    call = chat_call(body, request_id)
    context = await _context(gateway, body, api_key, request_id, bool(body.logprobs))
    shaper = _per_choice(lambda: ChatShaper(context, parser_for(call.tool_plan)), body.n)
    return await _respond(request, gateway, call, Caller(api_key, tenant), shaper, bool(body.stream), body.n or 1)


@router.get("/v1/models")
async def list_models(gateway: GatewayDep, api_key: ApiKey) -> JSONResponse:
    info = await gateway.model.info(api_key)
    return JSONResponse({"object": "list", "data": [_model_card(gateway, info)]})


@router.get("/v1/models/{model:path}")
async def retrieve_model(model: str, gateway: GatewayDep, api_key: ApiKey) -> JSONResponse:
    await gateway.model.resolve(model, api_key)
    return JSONResponse(_model_card(gateway, await gateway.model.info(api_key)))


@router.get("/health")
async def health(gateway: GatewayDep) -> JSONResponse:
    try:
        serving = await gateway.client.serving(timeout=gateway.settings.health_timeout_s)
    except SplitserveError as error:
        logger.info("event=health_unreachable code=%s details=%r", error.code.name, error.details)
        serving = False
    status = "serving" if serving else "not_serving"
    return JSONResponse({"status": status}, status_code=200 if serving else 503)


def trace_context(request: Request) -> dict[str, str]:
    """The caller's W3C trace context, passed on so a tracing scheduler continues its trace. A
    header gRPC metadata could not carry (not printable ASCII, or too long) is dropped, as W3C
    asks of an invalid one."""
    headers = {name: request.headers.get(name, "") for name in TRACE_CONTEXT_HEADERS}
    return {
        name: value
        for name, value in headers.items()
        if value and len(value) <= MAX_TRACE_HEADER_CHARS and value.isascii() and value.isprintable()
    }


async def _echo(gateway: Gateway, call: GenerateCall, api_key: str | None, shaper: CompletionShaper) -> None:
    """Readies the shaper to lead with the prompt: its text, and its first token (which no
    logprob scores) by name. The ids are the scheduler's: those Generate uses."""
    client = gateway.client
    try:
        ids = call.prompt_token_ids or (await client.tokenize(call.prompt, api_key=api_key)).token_ids
        text = call.prompt if call.prompt is not None else await client.detokenize(ids, api_key=api_key)
        first = await client.detokenize(ids[:1], api_key=api_key) if ids else ""
    except SplitserveError as error:
        raise from_splitserve(error) from None
    shaper.echo = text
    if ids:
        shaper.logprobs.echo_first = TokenLogprob(ids[0], 0.0, [], [], first.encode())
        shaper.logprobs.echo_length = len(text)


def _model_card(gateway: Gateway, info: pb.ModelInfo) -> dict[str, Any]:
    return {
        "id": gateway.model.name(info),
        "object": "model",
        "created": gateway.started,
        "owned_by": "splitserve",
        "root": info.model_id,
        "max_model_len": info.max_model_len,
    }


async def _context(
    gateway: Gateway, body: SamplingFields, api_key: str | None, request_id: str, want_logprobs: bool
) -> ResponseContext:
    return ResponseContext(
        id=request_id,
        created=int(time.time()),
        model=await gateway.model.resolve(body.model, api_key),
        include_usage=bool(body.stream_options and body.stream_options.include_usage),
        want_logprobs=want_logprobs,
    )


def _per_choice(make: Callable[[], Shaper], n: int | None) -> Shaper:
    """One choice's shaper, or with n > 1 one per choice."""
    return make() if (n or 1) == 1 else ChoiceShapers(make, n or 1)


async def _respond(
    request: Request,
    gateway: Gateway,
    call: GenerateCall,
    caller: Caller,
    shaper: Shaper,
    streaming: bool,
    num_choices: int = 1,
) -> Response:
    request_id = call.request_id
    try:
        stream = gateway.client.stream(
            call.prompt,
            prompt_token_ids=call.prompt_token_ids,
            messages=call.messages,
            api_key=caller.api_key,
            trace_context=trace_context(request),
            tenant=caller.tenant,
            **call.options,
        )
    except ValueError as error:
        raise bad_request(str(error)) from None
    try:
        if streaming:
            first = await first_delta(request, stream)
            return EventStreamResponse(event_stream(stream, first, shaper, request_id, num_choices))
        payload = shaper.whole(await collect(request, stream))
    except ClientDisconnected:
        logger.info(
            "event=client_disconnected request_id=%s streaming=%s",
            request_id, "true" if streaming else "false",
        )
        return Response(status_code=CLIENT_CLOSED_REQUEST)
    usage = payload["usage"] or {}
    logger.info(
        "event=request_finished request_id=%s streaming=false finish_reason=%s prompt_tokens=%s "
        "completion_tokens=%s",
        request_id, payload["choices"][0]["finish_reason"], usage.get("prompt_tokens"),
        usage.get("completion_tokens"),
    )
    return JSONResponse(payload)
