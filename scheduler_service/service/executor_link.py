"""The scheduler's connection to one executor: Describe, and the ordered plan/result stream."""

import asyncio
import logging

import grpc

from protos.limits import MAX_MESSAGE_BYTES
from protos.splitserve.executor.v1 import executor_pb2 as pb
from protos.splitserve.executor.v1 import executor_pb2_grpc

logger = logging.getLogger(__name__)

RETRY_MIN_S = 0.2
RETRY_MAX_S = 5.0
DESCRIBE_TIMEOUT_S = 5.0


class ExecutorLost(Exception):
    """The executor stopped answering; its state must be assumed gone."""


class ExecutorLink:
    def __init__(self, address: str, credentials: grpc.ChannelCredentials | None = None) -> None:
        self.address = address
        options = [
            ("grpc.max_send_message_length", MAX_MESSAGE_BYTES),
            ("grpc.max_receive_message_length", MAX_MESSAGE_BYTES),
        ]
        self._channel = (
            grpc.aio.secure_channel(address, credentials, options)
            if credentials
            else grpc.aio.insecure_channel(address, options)
        )
        self._stub = executor_pb2_grpc.ExecutorStub(self._channel)
        self._call: grpc.aio.StreamStreamCall | None = None

    async def connect(self) -> pb.ExecutorInfo:
        """Describes the executor, retrying until it answers, and opens a plan stream."""
        if self._call is not None:
            self._call.cancel()
            self._call = None
        delay = RETRY_MIN_S
        while True:
            try:
                info = await self._stub.Describe(pb.DescribeRequest(), timeout=DESCRIBE_TIMEOUT_S)
                break
            except grpc.aio.AioRpcError as error:
                logger.info(
                    "event=executor_unreachable address=%s code=%s retry_in_s=%.1f",
                    self.address, error.code().name, delay,
                )
                await asyncio.sleep(delay)
                delay = min(delay * 2, RETRY_MAX_S)
        self._call = self._stub.Execute()
        logger.info(
            "event=executor_connected address=%s model=%s incarnation=%s kv_blocks=%d block_size=%d",
            self.address, info.model_id, info.incarnation_id, info.num_kv_blocks, info.block_size,
        )
        return info

    async def send(self, plan: pb.StepPlan) -> None:
        try:
            await self._require_call().write(plan)
        except (grpc.aio.AioRpcError, asyncio.InvalidStateError) as error:
            raise ExecutorLost(f"sending step {plan.step_id}: {error}") from error

    async def receive(self) -> pb.StepResult:
        try:
            result = await self._require_call().read()
        except grpc.aio.AioRpcError as error:
            raise ExecutorLost(f"{error.code().name}: {error.details()}") from error
        if result is grpc.aio.EOF:
            raise ExecutorLost("the executor closed the plan stream")
        return result

    async def close(self) -> None:
        if self._call is not None:
            self._call.cancel()
        await self._channel.close()

    def _require_call(self) -> grpc.aio.StreamStreamCall:
        if self._call is None:
            raise ExecutorLost("not connected")
        return self._call
