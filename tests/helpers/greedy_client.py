"""Greedy generation of many prompts at once through a real scheduler, for parity tests."""

from __future__ import annotations

import asyncio
import random
from collections.abc import Callable

from clients import AsyncClient


def generate_greedy(address: str, prompts: list[list[int]], max_tokens: int) -> list[list[int]]:
    """Each prompt's output tokens (EOS ignored), all requests in flight together."""

    async def generate_all() -> list[list[int]]:
        async with AsyncClient(address) as client:
            results = await asyncio.gather(
                *(
                    client.generate(
                        prompt_token_ids=prompt, max_tokens=max_tokens, temperature=0, ignore_eos=True
                    )
                    for prompt in prompts
                )
            )
        return [result.token_ids for result in results]

    return asyncio.run(generate_all())


def workload(count: int, seed: int) -> list[tuple[list[int], int]]:
    rng = random.Random(seed)
    return [
        ([rng.randrange(3, 1000) for _ in range(rng.choice([1, 5, 17, 40, 90, 160, 230]))], rng.randrange(8, 33))
        for _ in range(count)
    ]


async def stream_all(
    address: str, jobs: list[tuple[list[int], int]], on_tokens: Callable[[int], None] = lambda count: None
) -> list[list[int]]:
    """Each job's greedy output, every stream open at once; on_tokens(count) hears of each
    message's tokens as it arrives (a fault test strikes on it, mid-generation)."""
    async with AsyncClient(address) as client:

        async def one(prompt: list[int], max_tokens: int) -> list[int]:
            tokens: list[int] = []
            async for delta in client.stream(
                prompt_token_ids=prompt, max_tokens=max_tokens, temperature=0, ignore_eos=True
            ):
                tokens.extend(delta.token_ids)
                on_tokens(len(delta.token_ids))
                if delta.finish_reason is not None:
                    assert delta.finish_reason == "length" and delta.usage is not None
                    assert delta.usage.completion_tokens == max_tokens
            return tokens

        return await asyncio.gather(*(one(p, m) for p, m in jobs))
