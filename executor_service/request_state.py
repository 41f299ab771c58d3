"""What the executor knows about each request: everything came in plans, so it is rebuildable."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from executor_service.sampling_params import SamplingParams


@dataclass(slots=True)
class RequestState:
    request_id: str
    # Every known token: prompt, tokens generated before any preemption, tokens sampled here.
    token_ids: list[int]
    # Tokens of token_ids that count as prompt for penalties; the rest count as output.
    num_prompt_tokens: int
    block_ids: list[int]
    num_computed_tokens: int
    sampling: SamplingParams
    # The request's own generator when seeded, so its draws ignore the rest of the batch.
    generator: torch.Generator | None

    @property
    def prompt_token_ids(self) -> list[int]:
        return self.token_ids[: self.num_prompt_tokens]

    @property
    def output_token_ids(self) -> list[int]:
        return self.token_ids[self.num_prompt_tokens :]


def make_generator(seed: int | None, device: torch.device) -> torch.Generator | None:
    if seed is None:
        return None
    generator = torch.Generator(device=device)
    generator.manual_seed(seed)
    return generator
