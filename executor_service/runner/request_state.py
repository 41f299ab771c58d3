"""What the executor knows about each request: everything came in plans, so it is rebuildable."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from executor_service.sampling.sampler_settings import SamplerSettings


@dataclass(slots=True)
class RequestState:
    request_id: str
    # Every known token: prompt, tokens generated before any preemption, tokens sampled here.
    token_ids: list[int]
    # Tokens of token_ids that count as prompt for penalties; the rest count as output.
    num_prompt_tokens: int
    # The block table from the plans: token i's K/V live in block_ids[i // block_size].
    block_ids: list[int]
    # Leading tokens whose K/V this executor has written (or the plan said were cached).
    num_computed_tokens: int
    sampling: SamplerSettings
    # The request's own generator when seeded, so its draws ignore the rest of the batch.
    generator: torch.Generator | None
    # Its name in StepPlan.decode_handles (0: none).
    handle: int = 0

    def seeded_generator(self) -> torch.Generator | None:
        """The generator, re-seeded for the position of the token about to be sampled.

        Seeding by position rather than carrying the generator's state from step to step means a
        request rebuilt after a preemption or an executor restart draws exactly what it would
        have drawn had it never been interrupted.
        """
        if self.generator is None or self.sampling.seed is None:
            return None
        return self.generator.manual_seed(position_seed(self.sampling.seed, len(self.token_ids)))

    @property
    def prompt_token_ids(self) -> list[int]:
        return self.token_ids[: self.num_prompt_tokens]

    @property
    def output_token_ids(self) -> list[int]:
        return self.token_ids[self.num_prompt_tokens :]

    @property
    def num_output_tokens(self) -> int:
        return len(self.token_ids) - self.num_prompt_tokens


_GOLDEN_GAMMA = 0x9E3779B97F4A7C15
_SEED_MASK = (1 << 63) - 1


def position_seed(seed: int, position: int) -> int:
    """A well-spread seed per (request seed, token position): splitmix64's finaliser."""
    value = (seed + position * _GOLDEN_GAMMA) & ((1 << 64) - 1)
    value = ((value ^ (value >> 30)) * 0xBF58476D1CE4E5B9) & ((1 << 64) - 1)
    value = ((value ^ (value >> 27)) * 0x94D049BB133111EB) & ((1 << 64) - 1)
    return (value ^ (value >> 31)) & _SEED_MASK


def make_generator(seed: int | None, device: torch.device) -> torch.Generator | None:
    if seed is None:
        return None
    return torch.Generator(device=device)
