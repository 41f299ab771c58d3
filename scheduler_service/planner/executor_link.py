"""The scheduler's connection to one executor: Describe, and the ordered plan/result stream.

The stream carries the scheduler's identity (metadata `x-splitserve-scheduler-id`), so an
executor held by another scheduler refuses it instead of being taken over, and every call carries
the executors' shared token when one is configured (`--executor-token-file`). HTTP/2 keepalive pings
find an executor that is alive but silent (a stopped process, a partition without a reset) and
keep the long-lived stream open through load balancers and mesh proxies that close idle
connections (see KEEPALIVE_OPTIONS).
"""

import asyncio
import logging

import grpc

from protos.executor_access import EXECUTOR_TOKEN_METADATA
from protos.limits import MAX_MESSAGE_BYTES
from protos.splitserve.executor.v1 import executor_pb2 as pb
from protos.splitserve.executor.v1 import executor_pb2_grpc
from service_support.transport_security import ClientTls, aio_channel

logger = logging.getLogger(__name__)

DESCRIBE_TIMEOUT_S = 5.0
# Metadata key of the identity the scheduler presents on Execute.
SCHEDULER_ID_METADATA = "x-splitserve-scheduler-id"
# A ping after 10 s without incoming data, answered within 10 s or the connection is closed and
# the stream fails. Ten seconds stays under the idle timeouts of common load balancers and proxies
# (60 s and more), and above the executor's accepted ping interval
# (executor_service/serving/server.py), so it is never answered with GOAWAY "too_many_pings".
# The answer's deadline is ping_timeout_ms: grpcio (1.85) times every ping, keepalive or flow
# control's, by it (default 60 s), and with keepalive_timeout_ms alone a SIGSTOPped executor
# outlived the 30 s step deadline. Now it is found in 10-20 s: a flow-control ping is often in
# flight when a peer stops, else the keepalive ping goes out 10 s after the last data. Pings are
# answered by gRPC's core threads, not by Python, so a long step does not delay the answer.
KEEPALIVE_OPTIONS = [
    ("grpc.keepalive_time_ms", 10_000),
    ("grpc.keepalive_timeout_ms", 10_000),
    ("grpc.http2.ping_timeout_ms", 10_000),
    ("grpc.keepalive_permit_without_calls", 1),
    ("grpc.http2.max_pings_without_data", 0),
]


class ExecutorLost(Exception):
    """The executor stopped answering; its state must be assumed gone."""


class ExecutorRefused(Exception):
    """The executor answers but will not take plans from this scheduler (held by another, or
    this scheduler lacks its token or an allowed certificate)."""


# Codes of an executor that answers but will not serve this scheduler: asking again soon will
# not change the answer, unlike a connection failure.
REFUSAL_CODES = (
    grpc.StatusCode.FAILED_PRECONDITION,
    grpc.StatusCode.UNAUTHENTICATED,
    grpc.StatusCode.PERMISSION_DENIED,
)


class ExecutorLink:
    def __init__(
        self,
        address: str,
        scheduler_id: str,
        tls: ClientTls | None = None,
        token: str | None = None,
    ) -> None:
        self.address = address
        self.scheduler_id = scheduler_id
        self._metadata: tuple[tuple[str, str], ...] = ((EXECUTOR_TOKEN_METADATA, token),) if token else ()
        options = [
            ("grpc.max_send_message_length", MAX_MESSAGE_BYTES),
            ("grpc.max_receive_message_length", MAX_MESSAGE_BYTES),
            *KEEPALIVE_OPTIONS,
        ]
        self._channel = aio_channel(address, options, tls)
        self._stub = executor_pb2_grpc.ExecutorStub(self._channel)
        self._call: grpc.aio.StreamStreamCall | None = None

    async def describe(self) -> pb.ExecutorInfo:
        """One Describe; ExecutorLost when the executor does not answer in time."""
        try:
            return await self._stub.Describe(
                pb.DescribeRequest(), timeout=DESCRIBE_TIMEOUT_S, metadata=self._metadata
            )
        except grpc.aio.AioRpcError as error:
            if error.code() in REFUSAL_CODES:
                raise ExecutorRefused(f"{error.code().name}: {error.details()}") from error
            raise ExecutorLost(f"Describe: {error.code().name}: {error.details()}") from error

    async def open_stream(self, handshake_timeout_s: float) -> None:
        """Opens the plan stream and waits for the answer to an empty plan (step 0), so a
        refusal (another scheduler holds the executor) is known before any real plan is sent."""
        self.close_stream()
        self._call = self._stub.Execute(
            metadata=((SCHEDULER_ID_METADATA, self.scheduler_id), *self._metadata)
        )
        await self.send(pb.StepPlan(step_id=0))
        try:
            await self.receive(handshake_timeout_s)
        except ExecutorLost as lost:
            cause = lost.__cause__
            if isinstance(cause, grpc.aio.AioRpcError) and cause.code() in REFUSAL_CODES:
                self.close_stream()
                raise ExecutorRefused(cause.details() or "refused") from cause
            raise
        logger.info(
            "event=executor_stream_opened address=%s scheduler_id=%s", self.address, self.scheduler_id
        )

    async def send(self, plan: pb.StepPlan) -> None:
        try:
            await self._require_call().write(plan)
        except (grpc.aio.AioRpcError, asyncio.InvalidStateError) as error:
            raise ExecutorLost(f"sending step {plan.step_id}: {error}") from error

    async def receive(self, timeout_s: float) -> pb.StepResult:
        """The next result; ExecutorLost if the stream breaks or nothing comes within timeout_s
        (an executor that is alive but frozen)."""
        try:
            # asyncio.timeout, not wait_for: no task of its own for every result read.
            async with asyncio.timeout(timeout_s):
                result = await self._require_call().read()
        except TimeoutError as error:
            raise ExecutorLost(f"no step result within {timeout_s:.1f} s") from error
        except grpc.aio.AioRpcError as error:
            raise ExecutorLost(f"{error.code().name}: {error.details()}") from error
        if result is grpc.aio.EOF:
            raise ExecutorLost("the executor closed the plan stream")
        return result

    def close_stream(self) -> None:
        """Ends the plan stream, which releases the executor's hold for this scheduler."""
        if self._call is not None:
            self._call.cancel()
            self._call = None

    async def close(self) -> None:
        self.close_stream()
        await self._channel.close()

    def _require_call(self) -> grpc.aio.StreamStreamCall:
        if self._call is None:
            raise ExecutorLost("not connected")
        return self._call
