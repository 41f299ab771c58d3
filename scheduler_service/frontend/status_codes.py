"""The one table that turns what went wrong with a request (core/errors.py) into the gRPC status
a client can act on, and back: the servicers answer with it, the planner's side of a front-end's
stream (tier/frontend_link.py) sends a failed request's code by it, and a front-end
(tier/planner_client.py) reads the kind back from that code."""

import math
from typing import NoReturn

import grpc

from scheduler_service.core.errors import ErrorKind, RequestError

# A request that can never fit this deployment (its KV cache, a tenant's whole quota) is
# FAILED_PRECONDITION, as gRPC says of what the system's setup must change for: under
# RESOURCE_EXHAUSTED, as overload is, clients retried it (OpenAI's SDKs retry a 429 twice, gRPC
# retry policies name that code), and it could only fail again. vLLM answers it 400, as the
# OpenAI gateway does FAILED_PRECONDITION.
STATUS_CODES = {
    ErrorKind.INVALID: grpc.StatusCode.INVALID_ARGUMENT,
    ErrorKind.UNSUPPORTED: grpc.StatusCode.FAILED_PRECONDITION,
    ErrorKind.TOO_LARGE: grpc.StatusCode.FAILED_PRECONDITION,
    ErrorKind.OVERLOADED: grpc.StatusCode.RESOURCE_EXHAUSTED,
    ErrorKind.DUPLICATE: grpc.StatusCode.ALREADY_EXISTS,
    ErrorKind.UNAVAILABLE: grpc.StatusCode.UNAVAILABLE,
    ErrorKind.INTERNAL: grpc.StatusCode.INTERNAL,
    ErrorKind.NOT_FOUND: grpc.StatusCode.NOT_FOUND,
}

# A status number back to a kind (the first kind of a shared code): a front-end passes on the
# planner's failures (tier/planner_client.py) with the code the planner chose.
KINDS_BY_CODE = {code.value[0]: kind for kind, code in reversed(STATUS_CODES.items())}


# Trailing metadata of a refused call: whole seconds after which it may succeed, as HTTP's
# Retry-After counts them (the message gives the exact figure).
RETRY_AFTER_METADATA = "retry-after"


async def abort_call(context: grpc.aio.ServicerContext, error: RequestError) -> NoReturn:
    """Ends the call with the error's status, and its retry-after hint when it has one (raises,
    as context.abort does)."""
    if error.retry_after_s is not None:
        context.set_trailing_metadata(((RETRY_AFTER_METADATA, str(max(1, math.ceil(error.retry_after_s)))),))
    await context.abort(STATUS_CODES[error.kind], error.message)
