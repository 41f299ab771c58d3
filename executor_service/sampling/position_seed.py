"""Seeded draws that do not depend on history: a seeded request's generator is re-seeded for the
position of each token it samples, so a request rebuilt after a preemption or an executor
restart draws exactly what it would have drawn had it never been interrupted."""

from __future__ import annotations

import torch

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
