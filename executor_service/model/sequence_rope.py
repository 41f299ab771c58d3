"""Rotary tables decided per sequence, for the RoPE types whose frequencies depend on length.

For `dynamic` (NTK) and `longrope`, transformers' dynamic_rope_update picks the frequencies from
the largest position in the forward (seq_len = max(position_ids) + 1). A step here is one
flattened row of many sequences, so a request's rotation would depend on what else is in the step
and on how its prompt was chunked (LongRoPE with an original length of 32: a 6-token request
beside a 60-token one diverged from transformers at its 18th token).

transformers' generate decides for one sequence: its prefill sees the prompt's length, each
decode step its position + 1. So each token here is given the length max(prompt length,
position + 1), the frequencies a fresh rotary module picks for that length, and the module's
own undecorated forward over the tokens of each length. A request's rotation is then a function
of its own prompt length and positions, whatever the batch and the chunking, and after a
recompute too (the executor keeps a request's original prompt length).
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from contextvars import ContextVar
from typing import Any

import torch
from torch import nn
from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

logger = logging.getLogger(__name__)

_LENGTHS: ContextVar[torch.Tensor | None] = ContextVar("splitserve_rope_lengths", default=None)


def depends_on_length(rope_type: object) -> bool:
    """The rope types transformers' dynamic_rope_update updates from the forward's positions."""
    return isinstance(rope_type, str) and ("dynamic" in rope_type or rope_type == "longrope")


def token_lengths(num_prompt_tokens: int, start: int, end: int) -> list[int]:
    """The sequence length transformers' generate sees when it computes each position in
    [start, end): the prompt's length in the prefill, position + 1 after it."""
    prompt_part = max(0, min(end, num_prompt_tokens) - start)
    return [num_prompt_tokens] * prompt_part + list(range(max(start, num_prompt_tokens) + 1, end + 1))


@contextmanager
def sequence_lengths(lengths: torch.Tensor | None) -> Iterator[None]:
    """Inside the block, rotary modules wrapped by install_sequence_rope take each token's
    length from `lengths` ([tokens] of the flattened step); None leaves them to transformers."""
    token = _LENGTHS.set(lengths)
    try:
        yield
    finally:
        _LENGTHS.reset(token)


class SequenceRope:
    """A rotary module's forward, per token length while sequence_lengths() gives them."""

    def __init__(self, module: nn.Module, undecorated: Callable[..., Any], decorated: Callable[..., Any]) -> None:
        self.module = module
        self.undecorated = undecorated
        self.decorated = decorated
        # What a fresh module scales by: dynamic growth replaces attention_scaling.
        self.initial_scaling = module.attention_scaling
        # longrope's long frequencies, by layer type, made once.
        self.long_inv_freq: dict[str | None, torch.Tensor] = {}

    def __call__(self, x: torch.Tensor, position_ids: torch.Tensor, layer_type: str | None = None) -> Any:
        kwargs = {} if layer_type is None else {"layer_type": layer_type}
        lengths = _LENGTHS.get()
        module = self.module
        rope_type = module.rope_type if layer_type is None else module.rope_type[layer_type]
        if lengths is None:
            return self.decorated(x, position_ids, **kwargs)
        if not depends_on_length(rope_type):
            return self.undecorated(module, x, position_ids, **kwargs)
        # transformers names a layer type's tables with its name as a prefix.
        prefix = "" if layer_type is None else f"{layer_type}_"
        name = f"{prefix}inv_freq"
        saved = getattr(module, name), module.attention_scaling
        try:
            distinct = torch.unique(lengths).tolist()
            if len(distinct) == 1:
                self._use_length(distinct[0], rope_type, prefix, layer_type, x.device)
                return self.undecorated(module, x, position_ids, **kwargs)
            cos = sin = None
            for length in distinct:
                index = (lengths == length).nonzero().squeeze(1)
                self._use_length(length, rope_type, prefix, layer_type, x.device)
                part_cos, part_sin = self.undecorated(module, x, position_ids[..., index], **kwargs)
                if cos is None or sin is None:
                    shape = (*part_cos.shape[:-2], lengths.shape[0], part_cos.shape[-1])
                    cos, sin = part_cos.new_empty(shape), part_sin.new_empty(shape)
                cos[..., index, :] = part_cos
                sin[..., index, :] = part_sin
            return cos, sin
        finally:
            setattr(module, name, saved[0])
            module.attention_scaling = saved[1]

    def _use_length(self, length: int, rope_type: str, prefix: str, layer_type: str | None, device: torch.device) -> None:
        """Sets the frequencies and scaling a fresh module would use for a sequence of `length`."""
        module = self.module
        config = module.config
        original = getattr(module, f"{prefix}original_inv_freq").to(device)
        layer_kwargs = {} if layer_type is None else {"layer_type": layer_type}
        if rope_type == "longrope":
            parameters = config.rope_parameters if layer_type is None else config.rope_parameters[layer_type]
            original_max = parameters["original_max_position_embeddings"]
            if layer_type not in self.long_inv_freq:
                self.long_inv_freq[layer_type] = ROPE_INIT_FUNCTIONS[rope_type](
                    config, device, seq_len=original_max + 1, **layer_kwargs
                )[0]
            inv_freq = self.long_inv_freq[layer_type] if length > original_max else original
            scaling = self.initial_scaling
        elif length > module.original_max_seq_len:
            inv_freq, scaling = ROPE_INIT_FUNCTIONS[rope_type](config, device, seq_len=length, **layer_kwargs)
        else:
            inv_freq, scaling = original, self.initial_scaling
        setattr(module, f"{prefix}inv_freq", inv_freq)
        module.attention_scaling = scaling


def install_sequence_rope(model: nn.Module) -> bool:
    """Wraps every rotary module of a length-dependent rope type; whether there was one."""
    installed = 0
    for module in model.modules():
        rope_type = getattr(module, "rope_type", None)
        types = rope_type.values() if isinstance(rope_type, dict) else [rope_type]
        undecorated = getattr(type(module).forward, "__wrapped__", None)
        if undecorated is None or not any(depends_on_length(kind) for kind in types):
            continue
        module.forward = SequenceRope(module, undecorated, module.forward)
        installed += 1
    if installed:
        logger.info("event=sequence_rope modules=%d", installed)
    return installed > 0
