"""Generate calls on raw grpc.aio stubs, each with its own metadata (an API key, a tenant named in
x-splitserve-tenant) and request fields (ttft_deadline_ms, tpot_target_ms), read to their end in
the background; each records what its client sees: when its first token came, its tokens, or
the status it ended with and the trailing metadata `retry-after`.

    async with grpc.aio.insecure_channel(address) as channel:
        call = GenerateCall(channel, token_request(max_tokens=50), api_key=KEY)
        await call.first_token.wait()
        outcome = await call.outcome()
"""

from __future__ import annotations

import asyncio
import time
from dataclasses import dataclass

import grpc

from protos.splitserve.v1 import generation_pb2 as pb
from protos.splitserve.v1 import generation_pb2_grpc

RETRY_AFTER = "retry-after"
TENANT_METADATA = "x-splitserve-tenant"


def token_request(max_tokens: int, prompt: tuple[int, ...] = (11, 12, 13, 14), **fields: object) -> pb.GenerateRequest:
    """A token-id prompt generating exactly max_tokens tokens (EOS ignored)."""
    sampling = pb.SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True)
    return pb.GenerateRequest(token_ids=pb.TokenIds(ids=list(prompt)), sampling=sampling, **fields)


def call_metadata(api_key: str | None = None, tenant: str | None = None) -> tuple[tuple[str, str], ...]:
    pairs: list[tuple[str, str]] = []
    if api_key is not None:
        pairs.append(("authorization", f"Bearer {api_key}"))
    if tenant is not None:
        pairs.append((TENANT_METADATA, tenant))
    return tuple(pairs)


@dataclass(slots=True, frozen=True)
class Outcome:
    code: grpc.StatusCode
    details: str
    # The trailing metadata's retry-after, as sent (None: none).
    retry_after: str | None
    token_ids: tuple[int, ...]
    # Seconds from the call's start to its first token (None: none came).
    ttft_s: float | None


class GenerateCall:
    def __init__(
        self,
        channel: grpc.aio.Channel,
        request: pb.GenerateRequest,
        api_key: str | None = None,
        tenant: str | None = None,
    ) -> None:
        self.first_token = asyncio.Event()
        self.sent_at = time.monotonic()
        self.first_token_at: float | None = None
        self._tokens: list[int] = []
        self._cancelled = False
        stub = generation_pb2_grpc.GenerationStub(channel)
        self._call = stub.Generate(request, metadata=call_metadata(api_key, tenant))
        self._task = asyncio.create_task(self._read())

    async def _read(self) -> Outcome:
        try:
            async for message in self._call:
                if message.token_ids and self.first_token_at is None:
                    self.first_token_at = time.monotonic()
                    self.first_token.set()
                self._tokens.extend(message.token_ids)
        except grpc.aio.AioRpcError as error:
            trailing = dict(error.trailing_metadata() or ())
            return Outcome(error.code(), error.details() or "", trailing.get(RETRY_AFTER), tuple(self._tokens), self._ttft())
        except asyncio.CancelledError:
            # grpc.aio ends a call cancelled on the client's side this way, not with its status.
            if not self._cancelled:
                raise
            return Outcome(grpc.StatusCode.CANCELLED, "cancelled by the test", None, tuple(self._tokens), self._ttft())
        trailing = dict(await self._call.trailing_metadata() or ())
        return Outcome(grpc.StatusCode.OK, "", trailing.get(RETRY_AFTER), tuple(self._tokens), self._ttft())

    def _ttft(self) -> float | None:
        return None if self.first_token_at is None else self.first_token_at - self.sent_at

    @property
    def tokens_received(self) -> int:
        return len(self._tokens)

    @property
    def done(self) -> bool:
        return self._task.done()

    async def outcome(self, timeout_s: float = 60.0) -> Outcome:
        return await asyncio.wait_for(asyncio.shield(self._task), timeout_s)

    async def started(self, timeout_s: float = 30.0) -> None:
        """Waits for its first token; AssertionError with its outcome when it ended without one."""
        waiter = asyncio.create_task(self.first_token.wait())
        await asyncio.wait({waiter, self._task}, timeout=timeout_s, return_when=asyncio.FIRST_COMPLETED)
        if not self.first_token.is_set():
            waiter.cancel()
            assert self._task.done(), f"no first token after {timeout_s} s"
            raise AssertionError(f"ended without a first token: {self._task.result()}")
        waiter.cancel()

    def cancel(self) -> None:
        self._cancelled = True
        self._call.cancel()


async def generate(
    channel: grpc.aio.Channel, request: pb.GenerateRequest, api_key: str | None = None, tenant: str | None = None
) -> Outcome:
    """One call, read to its end."""
    return await GenerateCall(channel, request, api_key, tenant).outcome()
