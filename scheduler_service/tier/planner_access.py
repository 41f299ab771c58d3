"""Who may call a planner: front-ends that send the planners' shared token
(--planner-token-file, metadata x-splitserve-planner-token), or anyone with --insecure-planner.
Whoever calls the Planner API can submit requests, read their tokens and drain executors, so a
planner is closed by default, as executors are. grpc.health.v1 stays open for probes."""

import hmac
import logging
from collections.abc import Awaitable, Callable

import grpc
from grpc_health.v1 import health

from scheduler_service.frontend.api_keys import refusing_handler

logger = logging.getLogger(__name__)

PLANNER_TOKEN_METADATA = "x-splitserve-planner-token"
_OPEN_PREFIX = f"/{health.SERVICE_NAME}/"
REFUSED = (
    "this planner takes calls only from front-ends that send its token: start the front-end with "
    "--planner-token-file naming the planner's token file"
)


class PlannerTokenInterceptor(grpc.aio.ServerInterceptor):
    def __init__(self, token: str) -> None:
        self._token = token.encode()

    async def intercept_service(
        self,
        continuation: Callable[[grpc.HandlerCallDetails], Awaitable[grpc.RpcMethodHandler]],
        details: grpc.HandlerCallDetails,
    ) -> grpc.RpcMethodHandler:
        handler = await continuation(details)
        if handler is None or details.method.startswith(_OPEN_PREFIX):
            return handler
        sent = dict(details.invocation_metadata or ()).get(PLANNER_TOKEN_METADATA, "")
        # Constant time, so timing tells nothing of a near miss.
        if hmac.compare_digest(str(sent).encode(), self._token):
            return handler
        logger.warning("event=planner_call_refused method=%r", details.method)
        return refusing_handler(handler, grpc.StatusCode.UNAUTHENTICATED, REFUSED)
