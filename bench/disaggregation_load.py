"""The client side of bench.disaggregation: steady streams (short prompts, long outputs) that
keep running while long prompts arrive at a fixed period, every token's arrival timed here, in
the client, as a user would see it."""

from __future__ import annotations

import asyncio
import logging
import math
import random
import time
from dataclasses import dataclass, field

from clients import AsyncClient

logger = logging.getLogger(__name__)


@dataclass(slots=True, frozen=True)
class LoadShape:
    steady_streams: int
    # Under the scheduler's --prefill-min-tokens, so with a decode executor they start there.
    steady_prompt_tokens: int
    steady_max_tokens: int
    long_prompt_tokens: int
    long_max_tokens: int
    arrival_s: float
    duration_s: float


@dataclass(slots=True)
class LoadResult:
    # Seconds between two deliveries to one steady request, for the gaps that ended inside the
    # window in which long prompts arrived.
    steady_gaps_s: list[float] = field(default_factory=list)
    # Send to first token of each long prompt.
    long_ttft_s: list[float] = field(default_factory=list)
    steady_tokens: int = 0
    window_s: float = 0.0
    sent: int = 0
    completed: int = 0

    @property
    def steady_tokens_per_s(self) -> float:
        return self.steady_tokens / self.window_s if self.window_s else 0.0


class Prompts:
    """Random prompts that share no cached block with one another (ids skip 0-2, special)."""

    def __init__(self, vocab_size: int, seed: int) -> None:
        self._rng = random.Random(seed)
        self._vocab_size = vocab_size

    def next(self, tokens: int) -> list[int]:
        return [self._rng.randrange(3, self._vocab_size) for _ in range(tokens)]


async def _stream(
    client: AsyncClient,
    prompt: list[int],
    max_tokens: int,
    result: LoadResult,
    first_delivery: asyncio.Event | None = None,
) -> list[tuple[float, int]]:
    """Streams one request to its end; returns each delivery's arrival time and token count.
    first_delivery: set when the first tokens arrive."""
    result.sent += 1
    deliveries = []
    async for delta in client.stream(prompt_token_ids=prompt, max_tokens=max_tokens, temperature=0, ignore_eos=True):
        if delta.token_ids:
            deliveries.append((time.perf_counter(), len(delta.token_ids)))
            if first_delivery is not None:
                first_delivery.set()
    result.completed += 1
    return deliveries


async def warm_up(address: str, shape: LoadShape, prompts: Prompts, long_prompts: int) -> None:
    """What every configuration gets before it is measured: one short request per steady
    stream at once, then long prompts one by one (the prefill path, and a move where there is one)."""
    result = LoadResult()
    async with AsyncClient(address) as client:
        await asyncio.gather(
            *(_stream(client, prompts.next(shape.steady_prompt_tokens), 16, result) for _ in range(shape.steady_streams))
        )
        for _ in range(long_prompts):
            await _stream(client, prompts.next(shape.long_prompt_tokens), 4, result)


async def send_long_prompts(address: str, shape: LoadShape, prompts: Prompts, count: int) -> LoadResult:
    """count long prompts, one after the other (each one's K/V moves alone), for shape.long_max_tokens each."""
    result = LoadResult()
    async with AsyncClient(address) as client:
        for _ in range(count):
            start = time.perf_counter()
            deliveries = await _stream(client, prompts.next(shape.long_prompt_tokens), shape.long_max_tokens, result)
            result.long_ttft_s.append(deliveries[0][0] - start)
    return result


async def run_load(address: str, shape: LoadShape, prompts: Prompts) -> LoadResult:
    """The steady streams start; once each has its first token the window opens, and a long
    prompt arrives at its start and every arrival_s within duration_s. Steady streams send a new
    request as each ends until the window closes, and every request runs to its end."""
    result = LoadResult()
    async with AsyncClient(address) as client:
        started = [asyncio.Event() for _ in range(shape.steady_streams)]
        window: list[float] = []

        async def steady(first_delivery: asyncio.Event) -> None:
            while not window or time.perf_counter() < window[1]:
                prompt = prompts.next(shape.steady_prompt_tokens)
                deliveries = await _stream(client, prompt, shape.steady_max_tokens, result, first_delivery)
                # Gaps within one request only: a new request's first token is its TTFT.
                for (before, _), (after, tokens) in zip(deliveries, deliveries[1:]):
                    if window and window[0] <= after <= window[1]:
                        result.steady_gaps_s.append(after - before)
                        result.steady_tokens += tokens

        async def long(send_at: float) -> None:
            await asyncio.sleep(max(0.0, send_at - time.perf_counter()))
            start = time.perf_counter()
            deliveries = await _stream(client, prompts.next(shape.long_prompt_tokens), shape.long_max_tokens, result)
            result.long_ttft_s.append(deliveries[0][0] - start)

        streams = [asyncio.create_task(steady(event)) for event in started]
        # Every steady stream delivering before the first long prompt arrives.
        await asyncio.gather(*(event.wait() for event in started))
        opened = time.perf_counter()
        window += [opened, opened + shape.duration_s]
        count = math.ceil(shape.duration_s / shape.arrival_s)
        longs = [long(opened + k * shape.arrival_s) for k in range(count)]
        logger.info("event=window_open long_prompts=%d duration_s=%g", len(longs), shape.duration_s)
        await asyncio.gather(*longs, *streams)
    result.window_s = shape.duration_s
    return result
