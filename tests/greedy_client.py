"""Greedy generation of many prompts at once through a real scheduler, for parity tests."""

from __future__ import annotations

import asyncio

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
