"""Requests with several choices (SamplingParams.n, best_of): one request per choice for the
planner, whose streams the client reads as one.

Choice i after the first is named `<request id>#i` and forks from the first (Request.fork_of):
the planner places it beside the first and shares that prompt's computation. Each choice samples
on its own: a seed s gives choice i the seed s + i, and an unseeded choice draws from the
executor's generator like any request. With best_of > n every choice reports its tokens'
logprobs (at least the sampled one's), by which the n most likely are kept.
"""

import asyncio
from dataclasses import replace

from protos.splitserve.v1 import generation_pb2 as pb
from scheduler_service.core.errors import RequestError
from scheduler_service.core.request import Request
from scheduler_service.frontend.output_stream import OutputStream, StreamItem
from scheduler_service.frontend.stream_backlog import PendingMessage

SEED_SPACE = 1 << 64


def choice_id(request_id: str, index: int) -> str:
    return request_id if index == 0 else f"{request_id}#{index}"


def fork_choices(request: Request) -> list[Request]:
    """The request's choices as requests of their own, the first under the request's own id."""
    sampling = request.sampling
    ranked = sampling.num_choices > sampling.n
    choices = []
    for index in range(sampling.num_choices):
        own = replace(
            sampling,
            n=1,
            best_of=None,
            seed=None if sampling.seed is None else (sampling.seed + index) % SEED_SPACE,
            logprobs=0 if ranked and sampling.logprobs is None else sampling.logprobs,
            # The prompt is scored once, with the first choice.
            prompt_logprobs=sampling.prompt_logprobs if index == 0 else None,
        )
        choice = Request(
            request_id=choice_id(request.request_id, index),
            prompt_token_ids=request.prompt_token_ids,
            sampling=own,
            priority=request.priority,
            cache_salt=request.cache_salt,
            tenant=request.tenant,
            ttft_deadline_s=request.ttft_deadline_s,
            tpot_target_s=request.tpot_target_s,
            fork_of="" if index == 0 else request.request_id,
        )
        choice.prefix_hashes = list(request.prefix_hashes)
        choice.prefix_hashes_block_size = request.prefix_hashes_block_size
        choices.append(choice)
    return choices


class ChoiceReader:
    """Reads the streams of one request's choices as one stream of messages, each naming its
    choice in `index` and carrying the client's request id.

    With n choices (best_of == n) messages go as they come, interleaved; with best_of > n every
    choice is read to its end first, then the n with the highest sum of token logprobs go, best
    first, renumbered 0..n-1, each whole in one message. An error in any choice ends the whole
    stream with it (the caller cancels the other choices)."""

    def __init__(self, request_id: str, streams: list[OutputStream], n: int, client_logprobs: bool) -> None:
        self.request_id = request_id
        self.streams = streams
        self._n = n
        self._ranked = len(streams) > n
        self._client_logprobs = client_logprobs
        self._reads: dict[asyncio.Future[StreamItem], int] = {}
        self._ready: list[pb.GenerateResponse] = []
        self._open = set(range(len(streams)))
        self._whole: dict[int, PendingMessage] = {}
        self._error: RequestError | None = None

    async def next_item(self) -> StreamItem:
        while not self._ready and self._open and self._error is None:
            await self._read_some()
        if self._error is not None:
            return self._error
        if self._ranked and not self._open and self._whole:
            self._ready = self._best()
            self._whole.clear()
        return self._ready.pop(0) if self._ready else None

    def close(self) -> None:
        """Stops the reads still waiting (the call is over)."""
        for read in self._reads:
            read.cancel()
        self._reads.clear()

    async def _read_some(self) -> None:
        for index in self._open - set(self._reads.values()):
            self._reads[asyncio.ensure_future(self.streams[index].next_item())] = index
        done, _ = await asyncio.wait(self._reads, return_when=asyncio.FIRST_COMPLETED)
        for read in sorted(done, key=self._reads.__getitem__):
            index = self._reads.pop(read)
            item = read.result()
            if item is None:
                self._open.discard(index)
            elif isinstance(item, RequestError):
                self._error = item
            elif self._ranked:
                pending = self._whole.get(index)
                if pending is None:
                    self._whole[index] = PendingMessage(item)
                else:
                    pending.fold(item)
            else:
                item.request_id, item.index = self.request_id, index
                self._ready.append(item)

    def _best(self) -> list[pb.GenerateResponse]:
        whole = {index: pending.take() for index, pending in self._whole.items()}
        ranked = sorted(whole, key=lambda index: (-sum(lp.logprob for lp in whole[index].logprobs), index))
        best = []
        for rank, index in enumerate(ranked[: self._n]):
            message = whole[index]
            message.request_id, message.index = self.request_id, rank
            if not self._client_logprobs:
                message.ClearField("logprobs")
            best.append(message)
        # The prompt's scores came with the first choice, which need not be among the best.
        scored = next((message for message in whole.values() if message.prompt_logprobs), None)
        if scored is not None and scored is not best[0]:
            best[0].prompt_logprobs.extend(scored.prompt_logprobs)
            scored.ClearField("prompt_logprobs")
        return best
