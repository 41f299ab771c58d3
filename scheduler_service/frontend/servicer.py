"""The client-facing Generation service."""

import logging
from collections.abc import AsyncIterator

import grpc

from protos.splitserve.executor.v1 import executor_pb2
from protos.splitserve.v1 import generation_pb2 as pb
from protos.splitserve.v1 import generation_pb2_grpc
from scheduler_service.core.errors import ErrorKind, RequestError, RequestRejected
from scheduler_service.core.sampling_params import SamplingDefaults
from scheduler_service.frontend.backend import Backend
from scheduler_service.frontend.choices import ChoiceReader, fork_choices
from scheduler_service.frontend.draining import refuse_when_draining
from scheduler_service.frontend.output_stream import OutputStream
from scheduler_service.frontend.request_intake import Intake
from scheduler_service.frontend.status_codes import STATUS_CODES, abort_call
from scheduler_service.frontend.tenant_of import TenantOf
from scheduler_service.frontend.tracing import TRACE_CONTEXT_KEYS

logger = logging.getLogger(__name__)



class GenerationServicer(generation_pb2_grpc.GenerationServicer):
    def __init__(self, engine: Backend, intake: Intake, tenant_of: TenantOf = TenantOf()) -> None:
        self.engine = engine
        self.intake = intake
        # Whose request a call is (its API key's tenant, or x-splitserve-tenant).
        self.tenant_of = tenant_of

    async def Generate(
        self, request: pb.GenerateRequest, context: grpc.aio.ServicerContext
    ) -> AsyncIterator[pb.GenerateResponse]:
        try:
            streams, reader = await self._submit(request, context)
        except RequestRejected as rejected:
            refusal: RequestError | None = rejected.as_error()
        else:
            refusal = None
        # The message (up to the receive limit) is dropped before any abort: grpc keeps an
        # aborted call's frames in reference cycles, freed only when the collector next runs,
        # and this frame would keep the message with them. An admitted prompt lives on in the
        # scheduler's request, so the message need not live as long as the stream either.
        del request
        if refusal is not None:
            await abort_call(context, refusal)
        scheduled = streams[0].request
        logger.info(
            "event=request_received request_id=%s tenant=%s prompt_tokens=%d priority=%d choices=%d",
            scheduled.request_id, scheduled.tenant, scheduled.num_prompt_tokens, scheduled.priority, len(streams),
        )
        # A cancelled call may never resume this handler (grpc can drop it while a message is
        # being sent), so the call's end, not only the handler's finally, frees the request.
        context.add_done_callback(lambda _: self._cancel(streams, reader))
        try:
            while (item := await reader.next_item()) is not None:
                if isinstance(item, RequestError):
                    await abort_call(context, item)
                yield item
        finally:
            self._cancel(streams, reader)
        request_done = streams[0].request
        logger.info(
            "event=request_finished request_id=%s reason=%s completion_tokens=%d",
            request_done.request_id,
            request_done.finish_reason.value if request_done.finish_reason else "abort",
            sum(stream.request.num_output_tokens for stream in streams),
        )

    async def _submit(
        self, request: pb.GenerateRequest, context: grpc.aio.ServicerContext
    ) -> tuple[list[OutputStream], OutputStream | ChoiceReader]:
        """The output streams of the new request's choices (one unless it asks for several)
        and what the client's messages are read from; RequestRejected saying why it cannot
        run."""
        refuse_when_draining(self.engine.draining)
        info = self._info()
        metadata = context.invocation_metadata() or ()
        tenant = self.tenant_of(metadata)
        scheduled = await self.intake.generate_request(request, info)
        scheduled.tenant = tenant
        carrier = {}
        if self.engine.wants_trace_context:
            # The caller's W3C trace context, which the request's span continues.
            carrier = {key: value for key, value in metadata if key in TRACE_CONTEXT_KEYS}
        sampling = scheduled.sampling
        if sampling.num_choices == 1:
            stream = self.engine.open_stream(scheduled, carrier)
            return [stream], stream
        streams: list[OutputStream] = []
        try:
            for choice in fork_choices(scheduled):
                streams.append(self.engine.open_stream(choice, carrier))
        except RequestRejected:
            self._cancel(streams)
            raise
        return streams, ChoiceReader(scheduled.request_id, streams, sampling.n, sampling.logprobs is not None)

    def _cancel(self, streams: list[OutputStream], reader: OutputStream | ChoiceReader | None = None) -> None:
        """The call is over: its requests end (if they still run) and what its client did not
        read is dropped now, not when the collector finds the call's reference cycles."""
        if isinstance(reader, ChoiceReader):
            reader.close()
        for stream in streams:
            if self.engine.cancel(stream):
                logger.info("event=request_cancelled request_id=%s", stream.request.request_id)
            stream.discard()

    async def Abort(self, request: pb.AbortRequest, context: grpc.aio.ServicerContext) -> pb.AbortResponse:
        try:
            return pb.AbortResponse(found=await self.engine.abort_request(request.request_id))
        except RequestRejected as rejected:
            await abort_call(context, rejected.as_error())

    async def Tokenize(self, request: pb.TokenizeRequest, context: grpc.aio.ServicerContext) -> pb.TokenizeResponse:
        info = self.engine.info
        try:
            ids = await self.intake.token_ids(request, info.max_model_len if info else None)
        except RequestRejected as rejected:
            refusal: RequestError | None = RequestError(rejected.kind, str(rejected))
        else:
            refusal = None
        if refusal is not None:
            await context.abort(STATUS_CODES[refusal.kind], refusal.message)
        pieces = self.engine.text.token_pieces(ids) if self.engine.text else []
        return pb.TokenizeResponse(token_ids=ids, tokens=pieces)

    async def Detokenize(
        self, request: pb.DetokenizeRequest, context: grpc.aio.ServicerContext
    ) -> pb.DetokenizeResponse:
        info = self.engine.info
        try:
            text = await self.intake.text_of(request, info.vocab_size if info else None)
        except RequestRejected as rejected:
            await context.abort(STATUS_CODES[rejected.kind], str(rejected))
        return pb.DetokenizeResponse(text=text)

    async def GetModelInfo(self, request: pb.GetModelInfoRequest, context: grpc.aio.ServicerContext) -> pb.ModelInfo:
        info = await self._require_info(context)
        text = self.engine.text
        eos = set(info.eos_token_ids) | set(text.eos_token_ids if text else ())
        return pb.ModelInfo(
            model_id=info.model_id,
            vocab_size=info.vocab_size,
            max_model_len=info.max_model_len,
            eos_token_ids=sorted(eos),
            has_tokenizer=text is not None,
            has_chat_template=bool(text and text.has_chat_template),
            block_size=info.block_size,
            max_logprobs=info.max_logprobs,
            sampling_defaults=defaults_to_proto(self.intake.defaults),
        )

    async def GetServerStatus(
        self, request: pb.GetServerStatusRequest, context: grpc.aio.ServicerContext
    ) -> pb.ServerStatus:
        try:
            return await self.engine.server_status()
        except RequestRejected as rejected:
            await abort_call(context, rejected.as_error())

    async def _require_info(self, context: grpc.aio.ServicerContext) -> executor_pb2.ExecutorInfo:
        try:
            return self._info()
        except RequestRejected as rejected:
            refusal = RequestError(rejected.kind, str(rejected))
        await context.abort(STATUS_CODES[refusal.kind], refusal.message)

    def _info(self) -> executor_pb2.ExecutorInfo:
        if self.engine.info is None:
            reason = self.engine.why_no_executor()
            raise RequestRejected(ErrorKind.UNAVAILABLE, f"no executor has been reached yet: {reason}")
        return self.engine.info


def defaults_to_proto(defaults: SamplingDefaults) -> pb.SamplingDefaults:
    return pb.SamplingDefaults(
        temperature=defaults.temperature,
        top_k=defaults.top_k,
        top_p=defaults.top_p,
        min_p=defaults.min_p,
        repetition_penalty=defaults.repetition_penalty,
        max_tokens=defaults.max_tokens,
        source=defaults.source,
    )
