"""How one step's flattened tokens split into the calls a recurrent mixer makes.

Attention reads a flattened step as one sequence with per-sequence metadata; a recurrent mixer
cannot, since its state would run from one request into the next. So each mixer is called once
per group: every decode of the step together ([requests, 1, hidden], rows independent), and each
prefill chunk on its own ([1, chunk, hidden]), cut where a checkpoint keeps the state at a point
inside it. Built once per step and shared by every layer.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from contextvars import ContextVar
from dataclasses import dataclass

import torch


@dataclass(slots=True, frozen=True)
class MixerCall:
    """One call of a mixer: `batch` sequences of `length` tokens each, whose tokens in the
    flattened step are token_index (sequence-major), whose state lives in `slots`; continuing:
    they have state from earlier tokens (else their state starts empty)."""

    token_index: torch.Tensor
    slots: torch.Tensor
    batch: int
    length: int
    continuing: bool
    # (state slot, checkpoint slot): once the call is done, the state of one of its sequences is
    # copied from its slot into a checkpoint's.
    keep: tuple[tuple[int, int], ...] = ()

    def one_token_calls(self) -> list[MixerCall]:
        """The same work as single-token calls, in order: for a mixer whose multi-token form
        ignores the state it is given (transformers' Mamba-1 scan starts every chunk from zero)."""
        last = self.length - 1
        return [
            MixerCall(self.token_index[i : i + 1], self.slots, 1, 1, self.continuing or i > 0, self.keep if i == last else ())
            for i in range(self.length)
        ]


@dataclass(slots=True, frozen=True)
class RecurrentStep:
    calls: tuple[MixerCall, ...]


@dataclass(slots=True, frozen=True)
class SequenceWork:
    """One sequence of the step as the split needs it; checkpoints: (n, slot) keeps the state
    after its first num_cached + n tokens in slot (0 < n <= num_new)."""

    token_start: int
    num_new: int
    num_cached: int
    slot: int
    checkpoints: tuple[tuple[int, int], ...] = ()

    @property
    def decodes(self) -> bool:
        """One token after earlier ones: it joins the step's batched decode call."""
        return self.num_new == 1 and self.num_cached > 0


def build_recurrent_step(sequences: list[SequenceWork], device: torch.device) -> RecurrentStep:
    decodes = [s for s in sequences if s.decodes]
    calls: list[MixerCall] = []
    if decodes:
        calls.append(
            MixerCall(
                token_index=torch.tensor([s.token_start for s in decodes], dtype=torch.long, device=device),
                slots=torch.tensor([s.slot for s in decodes], dtype=torch.long, device=device),
                batch=len(decodes),
                length=1,
                continuing=True,
                keep=tuple((s.slot, slot) for s in decodes for _, slot in s.checkpoints),
            )
        )
    for s in sequences:
        if not s.decodes:
            calls.extend(_chunk_calls(s, device))
    return RecurrentStep(tuple(calls))


def _chunk_calls(sequence: SequenceWork, device: torch.device) -> list[MixerCall]:
    """A prefill chunk as calls cut at its checkpoints, each continuing the one before."""
    slots = torch.tensor([sequence.slot], dtype=torch.long, device=device)
    ends = sorted({n for n, _ in sequence.checkpoints} | {sequence.num_new})
    calls: list[MixerCall] = []
    start = 0
    for end in ends:
        calls.append(
            MixerCall(
                token_index=torch.arange(sequence.token_start + start, sequence.token_start + end, device=device),
                slots=slots,
                batch=1,
                length=end - start,
                continuing=sequence.num_cached > 0 or start > 0,
                keep=tuple((sequence.slot, slot) for n, slot in sequence.checkpoints if n == end),
            )
        )
        start = end
    return calls


_ACTIVE: ContextVar[RecurrentStep | None] = ContextVar("splitserve_recurrent_step", default=None)


@contextmanager
def active_recurrent(step: RecurrentStep | None) -> Iterator[None]:
    """Makes `step` what every mixer called inside the block splits its input by; None leaves
    the mixers running the model's own way (a whole sequence, no state)."""
    token = _ACTIVE.set(step)
    try:
        yield
    finally:
        _ACTIVE.reset(token)


def current_recurrent() -> RecurrentStep | None:
    return _ACTIVE.get()
