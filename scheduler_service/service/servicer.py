"""The client-facing Generation service."""

import logging
from collections.abc import AsyncIterator

import grpc

from protos.splitserve.executor.v1 import executor_pb2
from protos.splitserve.v1 import generation_pb2 as pb
from protos.splitserve.v1 import generation_pb2_grpc
from scheduler_service.core.errors import ErrorKind, RequestError, RequestRejected
from scheduler_service.service.engine import Engine
from scheduler_service.service.output_stream import OutputStream
from scheduler_service.service.request_intake import build_request, prompt_token_ids

logger = logging.getLogger(__name__)

# The one place the scheduler turns what went wrong into a status a client can act on.
STATUS_CODES = {
    ErrorKind.INVALID: grpc.StatusCode.INVALID_ARGUMENT,
    ErrorKind.UNSUPPORTED: grpc.StatusCode.FAILED_PRECONDITION,
    ErrorKind.TOO_LARGE: grpc.StatusCode.RESOURCE_EXHAUSTED,
    ErrorKind.OVERLOADED: grpc.StatusCode.RESOURCE_EXHAUSTED,
    ErrorKind.DUPLICATE: grpc.StatusCode.ALREADY_EXISTS,
    ErrorKind.UNAVAILABLE: grpc.StatusCode.UNAVAILABLE,
    ErrorKind.INTERNAL: grpc.StatusCode.INTERNAL,
}


class GenerationServicer(generation_pb2_grpc.GenerationServicer):
    def __init__(self, engine: Engine) -> None:
        self.engine = engine

    async def Generate(
        self, request: pb.GenerateRequest, context: grpc.aio.ServicerContext
    ) -> AsyncIterator[pb.GenerateResponse]:
        info = await self._require_info(context)
        try:
            scheduled = build_request(request, self.engine.text, info.vocab_size, info.max_logprobs)
            stream = self.engine.submit(scheduled)
        except RequestRejected as rejected:
            await context.abort(STATUS_CODES[rejected.kind], str(rejected))
        logger.info(
            "event=request_received request_id=%s prompt_tokens=%d priority=%d",
            scheduled.request_id, scheduled.num_prompt_tokens, scheduled.priority,
        )
        # A cancelled call may never resume this handler (grpc can drop it while a message is
        # being sent), so the call's end, not only the handler's finally, frees the request.
        context.add_done_callback(lambda _: self._cancel(stream))
        try:
            while (item := await stream.queue.get()) is not None:
                if isinstance(item, RequestError):
                    await context.abort(STATUS_CODES[item.kind], item.message)
                yield item
        finally:
            self._cancel(stream)
        request_done = stream.request
        logger.info(
            "event=request_finished request_id=%s reason=%s completion_tokens=%d",
            request_done.request_id,
            request_done.finish_reason.value if request_done.finish_reason else "abort",
            request_done.num_output_tokens,
        )

    def _cancel(self, stream: OutputStream) -> None:
        if self.engine.cancel(stream):
            logger.info("event=request_cancelled request_id=%s", stream.request.request_id)

    async def Abort(self, request: pb.AbortRequest, context: grpc.aio.ServicerContext) -> pb.AbortResponse:
        return pb.AbortResponse(found=self.engine.abort(request.request_id))

    async def Tokenize(self, request: pb.TokenizeRequest, context: grpc.aio.ServicerContext) -> pb.TokenizeResponse:
        try:
            ids = prompt_token_ids(request, self.engine.text, "input")
        except RequestRejected as rejected:
            await context.abort(STATUS_CODES[rejected.kind], str(rejected))
        pieces = self.engine.text.token_pieces(ids) if self.engine.text else []
        return pb.TokenizeResponse(token_ids=ids, tokens=pieces)

    async def GetModelInfo(self, request: pb.GetModelInfoRequest, context: grpc.aio.ServicerContext) -> pb.ModelInfo:
        info = await self._require_info(context)
        text = self.engine.text
        scheduler = self.engine.scheduler
        return pb.ModelInfo(
            model_id=info.model_id,
            vocab_size=info.vocab_size,
            max_model_len=scheduler.config.max_seq_len if scheduler else info.max_model_len,
            eos_token_ids=sorted(scheduler.eos_token_ids) if scheduler else info.eos_token_ids,
            has_tokenizer=text is not None,
            has_chat_template=bool(text and text.has_chat_template),
            block_size=info.block_size,
            max_logprobs=info.max_logprobs,
        )

    async def GetServerStatus(
        self, request: pb.GetServerStatusRequest, context: grpc.aio.ServicerContext
    ) -> pb.ServerStatus:
        engine = self.engine
        scheduler = engine.scheduler
        status = pb.ServerStatus(policy=engine.options.policy.value, mode=engine.options.mode.value)
        executor = pb.ExecutorStatus(
            address=engine.link.address,
            state=pb.EXECUTOR_STATE_UP if engine.executor_up else pb.EXECUTOR_STATE_DOWN,
            incarnation_id=engine.info.incarnation_id if engine.info else "",
        )
        if scheduler is not None:
            stats = scheduler.kv.stats()
            status.num_waiting = len(scheduler.waiting)
            status.num_running = len(scheduler.running)
            status.kv_blocks_total = stats.num_blocks
            status.kv_blocks_free = stats.num_free_blocks
            status.prefix_cache_hit_rate = stats.hit_rate
            status.num_preemptions = scheduler.num_preemptions
            status.num_steps = scheduler.num_steps
            executor.kv_blocks_total = stats.num_blocks
            executor.kv_blocks_free = stats.num_free_blocks
            executor.num_running = len(scheduler.running)
        status.executors.append(executor)
        return status

    async def _require_info(self, context: grpc.aio.ServicerContext) -> executor_pb2.ExecutorInfo:
        if self.engine.info is None:
            await context.abort(
                STATUS_CODES[ErrorKind.UNAVAILABLE],
                f"the executor at {self.engine.link.address} has not been reached yet",
            )
        return self.engine.info
