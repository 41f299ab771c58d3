"""The Planner API on a planner: one Connect stream per front-end (frontend_link.py), and the
server status front-ends forward to their clients."""

import asyncio
import contextlib
import itertools
import logging
from collections.abc import AsyncIterator

import grpc
import numpy as np

from protos.splitserve.planner.v1 import planner_pb2, planner_pb2_grpc
from protos.splitserve.v1 import generation_pb2 as pb
from scheduler_service.core.errors import ErrorKind, RequestError, RequestRejected
from scheduler_service.core.request import Request
from scheduler_service.planner.engine import Engine
from scheduler_service.tier.frontend_link import FrontendLink, RemoteSink
from scheduler_service.tier.request_codec import request_of
from service_support.transport_security import peer_certificate_name

logger = logging.getLogger(__name__)

# A request's delivery key (Request.delivery_key) is its stream's index above these bits and
# its handle (a uint32 on the wire) in them.
_HANDLE_BITS = 32
_HANDLE_MASK = (1 << _HANDLE_BITS) - 1


class PlannerServicer(planner_pb2_grpc.PlannerServicer):
    def __init__(self, engine: Engine) -> None:
        self.engine = engine
        # Connect streams open now, by their index (the high half of their requests' delivery keys).
        self.links: dict[int, FrontendLink] = {}
        self._indexes = itertools.count(1)
        engine.bulk_delivery = self.deliver_bulk

    def status(self) -> planner_pb2.PlannerStatus:
        engine = self.engine
        status = planner_pb2.PlannerStatus(
            serving=engine.serving and not engine.draining,
            planner_id=engine.scheduler_id,
            draining=engine.draining,
        )
        if not engine.serving:
            status.reason = engine.why_no_executor()
        if engine.info is not None:
            status.model.CopyFrom(engine.info)
        return status

    def status_changed(self) -> None:
        """Tells every front-end (the engine's serving state or draining changed)."""
        status = self.status()
        for link in self.links.values():
            link.status(status)

    async def Connect(
        self, request_iterator: AsyncIterator[planner_pb2.FrontendBatch], context: grpc.aio.ServicerContext
    ) -> AsyncIterator[planner_pb2.PlannerBatch]:
        first = await anext(aiter(request_iterator), None)
        if first is None or not first.HasField("hello") or not first.hello.frontend_id:
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT, "a Connect stream starts with a hello naming the front-end")
        link = FrontendLink(first.hello.frontend_id, context.peer(), next(self._indexes))
        self.links[link.index] = link
        logger.info(
            "event=frontend_connected frontend=%s peer=%s certificate=%s",
            link.frontend_id, link.peer, peer_certificate_name(context) or "none",
        )
        link.status(self.status())
        await self._take(link, first)
        reader = asyncio.create_task(self._read(link, request_iterator))
        try:
            while (item := await link.outbox.get()) is not None:
                yield link.take(item)
        finally:
            reader.cancel()
            del self.links[link.index]
            # The front-end is gone or done with this planner: what it submitted is nobody's.
            left = list(link.requests.values())
            link.requests.clear()
            for sink in left:
                self.engine.cancel(sink)
            logger.info("event=frontend_disconnected frontend=%s aborted=%d", link.frontend_id, len(left))

    def deliver_bulk(self, keys: np.ndarray, token_ids: list[int]) -> None:
        """Steady decodes' tokens, one each, to the streams their keys name."""
        link_of = keys >> _HANDLE_BITS
        first = int(link_of[0])
        if (link_of == first).all():
            self._bulk_to(first, (keys & _HANDLE_MASK).tolist(), token_ids)
            return
        tokens = np.asarray(token_ids, dtype=np.int64)
        for index in np.flatnonzero(np.bincount(link_of)).tolist():
            chosen = link_of == index
            self._bulk_to(index, (keys[chosen] & _HANDLE_MASK).tolist(), tokens[chosen].tolist())

    def _bulk_to(self, index: int, handles: list[int], token_ids: list[int]) -> None:
        link = self.links.get(index)
        # Requests leave with their stream (Connect cancels them), so every key names a live
        # stream; were one not to, its tokens are dropped rather than failing the whole lane.
        if link is not None:
            link.bulk_tokens(handles, token_ids)

    async def GetServerStatus(self, request: pb.GetServerStatusRequest, context: grpc.aio.ServicerContext) -> pb.ServerStatus:
        return await self.engine.server_status()

    async def Abort(self, request: pb.AbortRequest, context: grpc.aio.ServicerContext) -> pb.AbortResponse:
        return pb.AbortResponse(found=self.engine.abort(request.request_id))

    async def _read(self, link: FrontendLink, batches: AsyncIterator[planner_pb2.FrontendBatch]) -> None:
        try:
            async for batch in batches:
                await self._take(link, batch)
        except grpc.RpcError as error:
            logger.info("event=frontend_stream_broken frontend=%s error=%r", link.frontend_id, error)
        finally:
            # The front-end closed its side (or broke it): the stream ends here too.
            link.close()

    async def _take(self, link: FrontendLink, batch: planner_pb2.FrontendBatch) -> None:
        """Submits the batch's requests (their grammars compiled first) and ends its ended ones."""
        built = [_built(submitted) for submitted in batch.submitted]
        await self._compile_grammars(built)
        self._apply(link, batch, built)

    async def _compile_grammars(self, built: list[Request | RequestRejected]) -> None:
        """Compiles the batch's grammars off the event loop, so that submitting the requests
        finds them cached; a grammar that fails is refused when its request is submitted."""
        info = self.engine.info
        if info is None:
            return
        for request in built:
            spec = request.sampling.structured_output if isinstance(request, Request) else None
            if spec is not None:
                with contextlib.suppress(RequestRejected):
                    await self.engine.grammars.compile(spec, info.vocab_size)

    def _apply(self, link: FrontendLink, batch: planner_pb2.FrontendBatch, built: list[Request | RequestRejected]) -> None:
        """built: the planner's request for each of the batch's submitted ones, or why there is none."""
        engine = self.engine
        for submitted, request in zip(batch.submitted, built, strict=True):
            handle = submitted.handle
            if handle in link.requests or handle == 0:
                link.failed(handle, RequestError(ErrorKind.INVALID, f"handle {handle} is 0 or already in flight on this stream"))
                continue
            if isinstance(request, RequestRejected):
                link.failed(handle, request.as_error())
                continue
            try:
                request.delivery_key = link.index << _HANDLE_BITS | handle
                sink = engine.submit(
                    request, dict(submitted.trace_context), lambda r, h=handle: RemoteSink(r, link, h),
                    resumed=bool(submitted.num_planner_losses or submitted.output_token_ids),
                )
            except RequestRejected as rejected:
                link.failed(handle, rejected.as_error())
                continue
            assert isinstance(sink, RemoteSink)
            link.requests[handle] = sink
        for ended in batch.ended:
            sink = link.requests.pop(ended.handle, None)
            if sink is None:
                continue
            if ended.stop_string:
                engine.stop_at_string(sink, ended.stop_string)
            else:
                engine.cancel(sink)


def _built(submitted: planner_pb2.SubmittedRequest) -> Request | RequestRejected:
    """The planner's request for a submitted one (its grammar parsed once, here), or why not."""
    try:
        return request_of(submitted)
    except RequestRejected as rejected:
        return rejected
