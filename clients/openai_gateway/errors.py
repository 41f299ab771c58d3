"""Errors in OpenAI's JSON shape, `{"error": {"message", "type", "param", "code"}}`, with the
HTTP status a client of OpenAI's API expects, for the gateway's own refusals and for the
scheduler's gRPC statuses alike.

Every 4xx is the caller's to fix (type invalid_request_error unless a more precise one applies),
every 5xx the server's (server_error). Overload is OpenAI's: RESOURCE_EXHAUSTED becomes 429
rate_limit_error with code rate_limit_exceeded, which OpenAI's clients retry after a pause (the
scheduler's retry-after, when it gives one: a tenant over its quota, a deadline predicted to be
missed); UNAVAILABLE becomes 503, also retried.
"""

from __future__ import annotations

import logging
import math
from collections.abc import Mapping
from typing import Any

import grpc
from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse
from starlette.exceptions import HTTPException

from clients.errors import SplitserveError

logger = logging.getLogger(__name__)

HTTP_STATUS: dict[grpc.StatusCode, int] = {
    grpc.StatusCode.INVALID_ARGUMENT: 400,
    grpc.StatusCode.FAILED_PRECONDITION: 400,
    grpc.StatusCode.UNAUTHENTICATED: 401,
    grpc.StatusCode.PERMISSION_DENIED: 403,
    grpc.StatusCode.NOT_FOUND: 404,
    grpc.StatusCode.ALREADY_EXISTS: 409,
    grpc.StatusCode.RESOURCE_EXHAUSTED: 429,
    grpc.StatusCode.UNAVAILABLE: 503,
    grpc.StatusCode.DEADLINE_EXCEEDED: 504,
}

ERROR_TYPES: dict[int, str] = {
    401: "authentication_error",
    403: "permission_error",
    404: "not_found_error",
    409: "conflict_error",
    429: "rate_limit_error",
}
SERVED_ROUTES = "/v1/completions, /v1/chat/completions, /v1/models, /tokenize, /detokenize, /version, /health"
# The code OpenAI's API gives its 429s; other statuses carry the scheduler's status name.
RATE_LIMIT_CODE = "rate_limit_exceeded"


def default_error_type(status: int) -> str:
    if status in ERROR_TYPES:
        return ERROR_TYPES[status]
    return "invalid_request_error" if 400 <= status < 500 else "server_error"


class GatewayError(Exception):
    """A request that ends with an OpenAI-style error response (or SSE error event)."""

    def __init__(
        self,
        status: int,
        message: str,
        *,
        param: str | None = None,
        code: str | None = None,
        error_type: str | None = None,
        headers: Mapping[str, str] | None = None,
    ) -> None:
        super().__init__(message)
        self.status = status
        self.message = message
        self.param = param
        self.code = code
        self.error_type = error_type or default_error_type(status)
        self.headers = dict(headers or {})

    def body(self) -> dict[str, Any]:
        return {
            "error": {
                "message": self.message,
                "type": self.error_type,
                "param": self.param,
                "code": self.code,
            }
        }

    def response(self, request: Request) -> JSONResponse:
        # The path is the caller's text, decoded: quoted, so no control character or forged
        # `key=value` of its own reaches the log.
        logger.info(
            "event=request_refused method=%r path=%r status=%d code=%s message=%r",
            request.method, request.url.path, self.status, self.code, self.message,
        )
        return JSONResponse(self.body(), status_code=self.status, headers=self.headers)


def bad_request(message: str, param: str | None = None) -> GatewayError:
    return GatewayError(400, message, param=param)


def unsupported(param: str, message: str) -> GatewayError:
    return GatewayError(400, message, param=param, code="unsupported_parameter")


# What gRPC itself says, as RESOURCE_EXHAUSTED, of a message over the scheduler's
# --max-message-bytes: it refused the message unread, and sending it again cannot help.
TRANSPORT_REFUSAL = "Received message larger than max"


def from_splitserve(error: SplitserveError) -> GatewayError:
    """The scheduler's status as HTTP; its message is passed on unchanged (it names the field),
    and its retry-after hint as the Retry-After header (whole seconds), which OpenAI's clients
    wait out before they retry. A request too large for the scheduler to read at all is 413,
    which they do not retry, rather than the 429 of overload."""
    if error.code is grpc.StatusCode.RESOURCE_EXHAUSTED and TRANSPORT_REFUSAL in error.details:
        message = (
            f"the request is larger than the scheduler reads ({error.details}); its prompt caps are "
            "the scheduler's --max-prompt-bytes and --max-prompt-tokens"
        )
        return GatewayError(413, message, code="request_too_large")
    status = HTTP_STATUS.get(error.code, 500)
    headers: dict[str, str] = {}
    if error.retry_after_s is not None:
        headers["Retry-After"] = str(max(1, math.ceil(error.retry_after_s)))
    return GatewayError(
        status,
        error.details or error.code.name,
        code=RATE_LIMIT_CODE if status == 429 else error.code.name.lower(),
        headers=headers,
    )


def from_http_exception(request: Request, error: HTTPException) -> GatewayError:
    """Starlette's own refusals (unknown route, wrong method) in OpenAI's shape, saying what to
    send instead."""
    headers = dict(error.headers or {})
    if error.status_code == 404:
        message = f"there is no route {request.url.path!r} (this server serves {SERVED_ROUTES})"
        return GatewayError(404, message, code="not_found")
    if error.status_code == 405:
        allowed = headers.get("Allow") or "another method"
        message = f"{request.method} is not allowed on {request.url.path!r}; use {allowed}"
        return GatewayError(405, message, code="method_not_allowed", headers=headers)
    return GatewayError(error.status_code, str(error.detail), headers=headers)


def validation_error(error: RequestValidationError) -> GatewayError:
    """Pydantic's complaints as one 400 (FastAPI's default is a 422 in its own shape)."""
    problems: list[str] = []
    first_param: str | None = None
    unknown_field = False
    for item in error.errors():
        if item.get("type") == "json_invalid":
            # Its location is a character position, not a field.
            reason = item.get("ctx", {}).get("error", "")
            problems.append(f"the body is not valid JSON ({reason})")
            continue
        path = ".".join(str(part) for part in item.get("loc", ()) if part != "body") or "body"
        first_param = first_param or path
        if item.get("type") == "extra_forbidden":
            unknown_field = True
            problems.append(f"{path}: unsupported field (this server does not implement it)")
        else:
            problems.append(f"{path}: {item.get('msg', 'invalid value')}")
    code = "unsupported_parameter" if unknown_field else None
    return GatewayError(400, "; ".join(problems), param=first_param, code=code)


def install_error_handlers(app: FastAPI) -> None:
    @app.exception_handler(GatewayError)
    async def on_gateway_error(request: Request, error: GatewayError) -> JSONResponse:
        return error.response(request)

    @app.exception_handler(SplitserveError)
    async def on_splitserve_error(request: Request, error: SplitserveError) -> JSONResponse:
        return from_splitserve(error).response(request)

    @app.exception_handler(RequestValidationError)
    async def on_validation_error(request: Request, error: RequestValidationError) -> JSONResponse:
        return validation_error(error).response(request)

    @app.exception_handler(HTTPException)
    async def on_http_error(request: Request, error: HTTPException) -> JSONResponse:
        # Unknown routes and methods, in the same shape as every other error.
        return from_http_exception(request, error).response(request)

    @app.exception_handler(Exception)
    async def on_unexpected_error(request: Request, error: Exception) -> JSONResponse:
        logger.exception("event=gateway_internal_error path=%r", request.url.path)
        return GatewayError(500, f"internal error: {type(error).__name__}").response(request)
