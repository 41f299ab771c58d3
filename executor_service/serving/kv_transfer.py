"""The KvTransfer gRPC service: other executors fetch the blocks this one offers."""

from __future__ import annotations

import asyncio
import logging
from collections.abc import AsyncIterator
from concurrent.futures import ThreadPoolExecutor

import grpc

from executor_service.serving.access import ExecutorAccess
from executor_service.serving.kv_moves import KvMoves, OfferClosed, logged_id
from executor_service.serving.metrics import ExecutorMetrics
from protos.splitserve.executor.v1 import executor_pb2, executor_pb2_grpc

logger = logging.getLogger(__name__)

KV_TRANSFER_SERVICE = executor_pb2.DESCRIPTOR.services_by_name["KvTransfer"].full_name


class KvTransferServicer(executor_pb2_grpc.KvTransferServicer):
    """Callers are admitted by ExecutorAccess.peer_refusal. Each chunk is read on the worker
    thread (the only one that touches the cache), between plans, so a fetch never sees a block
    half-written and never stalls a step for longer than one chunk's copy."""

    def __init__(
        self, moves: KvMoves, worker: ThreadPoolExecutor, access: ExecutorAccess, metrics: ExecutorMetrics
    ) -> None:
        self._moves = moves
        self._worker = worker
        self._access = access
        self._metrics = metrics

    async def FetchBlocks(
        self, request: executor_pb2.FetchBlocksRequest, context: grpc.aio.ServicerContext
    ) -> AsyncIterator[executor_pb2.KvBlockChunk]:
        refusal = self._access.peer_refusal(context)
        if refusal is not None:
            logger.warning(
                "event=call_refused method=FetchBlocks peer=%s code=%s", context.peer(), refusal.code.name
            )
            await context.abort(refusal.code, refusal.message)
        loop = asyncio.get_running_loop()
        position, sent = request.first_block, 0
        while True:
            try:
                chunk = await loop.run_in_executor(
                    self._worker, self._moves.read_chunk, request.transfer_id, position
                )
            except OfferClosed:
                # ABORTED once chunks went out: the offer ended under the reader, and what it got
                # is not the whole of it.
                code = grpc.StatusCode.NOT_FOUND if position == request.first_block else grpc.StatusCode.ABORTED
                logger.info(
                    "event=kv_fetch_refused transfer=%s position=%d code=%s peer=%s",
                    logged_id(request.transfer_id), position, code.name, context.peer(),
                )
                await context.abort(
                    code,
                    f"no open offer of transfer id {request.transfer_id!r} on this executor (never made, "
                    "ended by the scheduler, or dropped when its plan stream started over)",
                )
            if chunk is None:
                break
            yield chunk
            size = len(chunk.data) + len(chunk.state)
            self._metrics.kv_transfer_bytes.labels("sent").inc(size)
            position += chunk.num_blocks
            sent += size
            if chunk.state:
                # The state is the offer's last chunk.
                break
        logger.info(
            "event=kv_fetch_served transfer=%s first_block=%d blocks=%d bytes=%d peer=%s",
            logged_id(request.transfer_id), request.first_block, position - request.first_block, sent, context.peer(),
        )
