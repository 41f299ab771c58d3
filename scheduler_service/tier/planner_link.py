"""A front-end's Connect stream to one planner: reached again whenever it breaks, batches out
(gathered over one turn of the event loop), batches in handed to the front-end's client."""

import asyncio
import logging
from collections.abc import Callable

import grpc

from protos.limits import MAX_MESSAGE_BYTES
from protos.splitserve.planner.v1 import planner_pb2, planner_pb2_grpc
from protos.splitserve.v1 import generation_pb2 as pb
from scheduler_service.planner.executor_link import KEEPALIVE_OPTIONS
from scheduler_service.tier.planner_access import PLANNER_TOKEN_METADATA
from service_support.transport_security import ClientTls, aio_channel

logger = logging.getLogger(__name__)

RETRY_MIN_S = 0.1
RETRY_MAX_S = 2.0


class PlannerLink:
    def __init__(
        self,
        address: str,
        token: str | None,
        frontend_id: str,
        on_batch: Callable[["PlannerLink", planner_pb2.PlannerBatch], None],
        on_lost: Callable[["PlannerLink", str], None],
        tls: ClientTls | None = None,
    ) -> None:
        self.address = address
        self.frontend_id = frontend_id
        self._on_batch = on_batch
        self._on_lost = on_lost
        self.metadata: tuple[tuple[str, str], ...] = ((PLANNER_TOKEN_METADATA, token),) if token else ()
        options = [
            ("grpc.max_send_message_length", MAX_MESSAGE_BYTES),
            ("grpc.max_receive_message_length", MAX_MESSAGE_BYTES),
            # A frozen planner is found in 10-20 s, as a frozen executor is.
            *KEEPALIVE_OPTIONS,
        ]
        self.channel = aio_channel(address, options, tls)
        self._stub = planner_pb2_grpc.PlannerStub(self.channel)
        # The planner's status once its stream is up (None while it is not).
        self.status: planner_pb2.PlannerStatus | None = None
        # Why it is not up, for clients' messages.
        self.reason = "not reached yet"
        self._call: grpc.aio.StreamStreamCall | None = None
        self._gathered: planner_pb2.FrontendBatch | None = None
        self._outbox: asyncio.Queue[planner_pb2.FrontendBatch] = asyncio.Queue()

    @property
    def up(self) -> bool:
        return self.status is not None

    @property
    def serving(self) -> bool:
        return self.status is not None and self.status.serving

    def submit(self, request: planner_pb2.SubmittedRequest) -> None:
        self._gather().submitted.append(request)

    def end(self, handle: int, stop_string: str = "") -> None:
        self._gather().ended.add(handle=handle, stop_string=stop_string)

    async def server_status(self) -> pb.ServerStatus:
        return await self._stub.GetServerStatus(pb.GetServerStatusRequest(), metadata=self.metadata, timeout=10)

    async def abort(self, request_id: str) -> bool:
        reply = await self._stub.Abort(pb.AbortRequest(request_id=request_id), metadata=self.metadata, timeout=10)
        return reply.found

    async def run(self) -> None:
        """Keeps the stream up: reached, read until it breaks, reached again."""
        delay = RETRY_MIN_S
        while True:
            try:
                await self._stream()
                reason = "the planner ended the stream"
            except grpc.aio.AioRpcError as error:
                reason = f"{error.code().name}: {error.details()}"
            if self.status is not None:
                self.status = None
                self.reason = reason
                logger.warning("event=planner_lost address=%s reason=%r", self.address, reason)
                self._on_lost(self, reason)
                delay = RETRY_MIN_S
            else:
                self.reason = reason
            await asyncio.sleep(delay)
            delay = min(delay * 2, RETRY_MAX_S)

    async def close(self) -> None:
        if self._call is not None:
            self._call.cancel()
        await self.channel.close()

    async def _stream(self) -> None:
        self._outbox = asyncio.Queue()
        self._gathered = None
        call = self._call = self._stub.Connect(metadata=self.metadata)
        await call.write(planner_pb2.FrontendBatch(hello=planner_pb2.Hello(frontend_id=self.frontend_id)))
        writer = asyncio.create_task(self._write(call))
        try:
            while (batch := await call.read()) is not grpc.aio.EOF:
                if batch.HasField("status") and self.status is None:
                    logger.info("event=planner_connected address=%s planner=%s serving=%s",
                                self.address, batch.status.planner_id, batch.status.serving)
                if batch.HasField("status"):
                    self.status = batch.status
                self._on_batch(self, batch)
        finally:
            writer.cancel()
            call.cancel()
            self._call = None

    async def _write(self, call: grpc.aio.StreamStreamCall) -> None:
        while True:
            batch = await self._outbox.get()
            if batch is self._gathered:
                self._gathered = None
            await call.write(batch)

    def _gather(self) -> planner_pb2.FrontendBatch:
        """The batch queued and not yet taken by the writer, which goes on gathering until it
        is: one turn of the event loop's submissions while the writer is idle, all of them since
        its last write while it is busy (what a stream gathers while it is down is dropped when
        it is reached again: what it held is submitted afresh then)."""
        if self._gathered is None:
            self._gathered = planner_pb2.FrontendBatch()
            self._outbox.put_nowait(self._gathered)
        return self._gathered
