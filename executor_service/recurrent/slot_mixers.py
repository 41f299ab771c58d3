"""The model's own recurrent mixers, run against state slots.

Each mixer module (a Mamba mixer, a Gated DeltaNet, a short convolution, a lightning attention)
keeps its code; its forward is wrapped so that, inside a step, it is called once per MixerCall of
the step (recurrent_step.py) with that call's slice of every per-token argument and a SlotStates
as its cache, and the outputs are put back in the flattened step's order. Outside a step (the
self-check's reference forward) the mixer runs as transformers wrote it.

Mixers are found without a list of classes: a module with a layer_idx whose forward takes a
`cache`, holding no attention module and no other such module, is a candidate; a probe forward
over a few tokens keeps those that store state through the cache interface, and records what
they store (StateLayout).
"""

from __future__ import annotations

import inspect
import logging
import re
from collections.abc import Iterator
from contextlib import contextmanager
from contextvars import ContextVar
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from executor_service.attention.paged_attention import probing
from executor_service.recurrent.recurrent_step import MixerCall, current_recurrent
from executor_service.recurrent.slot_cache import SlotStates, StateRecorder
from executor_service.recurrent.state_slots import StateLayout, StateSlots

logger = logging.getLogger(__name__)

_CACHE_PARAMETERS = ("cache", "cache_params")
_RECORDING: ContextVar[StateRecorder | None] = ContextVar("splitserve_state_recorder", default=None)


@dataclass(slots=True)
class RecurrentLayers:
    """A model's recurrent mixers, what they keep per sequence, and where it is kept."""

    mixers: dict[int, SlotMixer]
    layout: StateLayout
    # Set once start-up allocates them.
    states: StateSlots | None = None
    # The model's multi-token form ignores the state it is handed (transformers' Mamba-1 scan),
    # so a chunk that continues a sequence runs one token at a time; the self-check decides.
    one_token_continuations: bool = False

    @property
    def layers(self) -> tuple[int, ...]:
        return self.layout.layers

    def weights_read(self) -> frozenset[int]:
        """id()s of the mixers' linear layers whose weight the mixer's forward reads itself
        (Mamba's `self.dt_proj.weight @ ...`), which must stay nn.Linear."""
        found: set[int] = set()
        for mixer in self.mixers.values():
            source = inspect.getsource(type(mixer.module).forward)
            for name, child in mixer.module.named_children():
                if isinstance(child, nn.Linear) and re.search(rf"self\.{re.escape(name)}\.weight\b", source):
                    found.add(id(child))
        return frozenset(found)


class SlotMixer:
    """Stands in for one mixer module's forward (set on the instance, so the module, its name
    and its weights stay where transformers put them)."""

    def __init__(self, module: nn.Module, owner: RecurrentLayers | None = None) -> None:
        self.module = module
        self.owner = owner
        self.original = module.forward
        self.signature = inspect.signature(self.original)
        parameters = list(self.signature.parameters.values())
        self.explicit = {
            p.name for p in parameters if p.kind not in (inspect.Parameter.VAR_KEYWORD, inspect.Parameter.VAR_POSITIONAL)
        }
        self.cache_name = next(name for name in _CACHE_PARAMETERS if name in self.explicit)
        self.hidden_name = parameters[0].name
        # Set by the probe when the module used its cache as something other than recurrent
        # state (an attention module outside AttentionInterface calls cache.update).
        self.not_recurrent = False

    def install(self) -> None:
        self.module.forward = self

    def uninstall(self) -> None:
        del self.module.forward

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        recorder = _RECORDING.get()
        step = current_recurrent()
        if recorder is None and step is None:
            return self.original(*args, **kwargs)
        bound = self.signature.bind(*args, **kwargs).arguments
        # Only the mixer's own parameters: the step's extra keywords (our attention metadata)
        # would reach kernels that take **kwargs. The flattened step has no padding to mask.
        arguments = {name: value for name, value in bound.items() if name in self.explicit}
        if "attention_mask" in arguments:
            arguments["attention_mask"] = None
        if recorder is not None:
            try:
                return self.original(**{**arguments, self.cache_name: recorder})
            except AttributeError:
                # It asked the cache for what recurrent state has not: not a recurrent mixer. It
                # runs as the model called it, so the probe goes on.
                self.not_recurrent = True
                return self.original(*args, **kwargs)
        assert self.owner is not None and self.owner.states is not None
        hidden = arguments[self.hidden_name]
        num_tokens = hidden.shape[1]
        output: torch.Tensor | None = None
        extra: tuple[Any, ...] | None = None
        for call in step.calls:
            for piece in self._pieces(call):
                cache = SlotStates(self.owner.states, piece.slots, piece.continuing)
                sliced = {name: _take(value, piece, num_tokens) for name, value in arguments.items()}
                sliced[self.cache_name] = cache
                result = self.original(**sliced)
                cache.commit()
                for source, checkpoint in piece.keep:
                    self.owner.states.copy_layer(self.module.layer_idx, source, checkpoint)
                out = result[0] if isinstance(result, tuple) else result
                if output is None:
                    output = out.new_empty((1, num_tokens, *out.shape[2:]))
                    extra = (None,) * (len(result) - 1) if isinstance(result, tuple) else None
                output[0].index_copy_(0, piece.token_index, out.reshape(-1, *out.shape[2:]))
        assert output is not None
        return output if extra is None else (output, *extra)

    def _pieces(self, call: MixerCall) -> list[MixerCall]:
        assert self.owner is not None
        if self.owner.one_token_continuations and call.continuing and call.length > 1:
            return call.one_token_calls()
        return [call]


def _take(value: Any, call: MixerCall, num_tokens: int) -> Any:
    """The call's part of a per-token argument ([1, tokens, ...] tensors, also inside tuples
    such as position embeddings), as [batch, length, ...]; anything else as it is."""
    if isinstance(value, torch.Tensor) and value.dim() >= 2 and value.shape[0] == 1 and value.shape[1] == num_tokens:
        return value[0].index_select(0, call.token_index).view(call.batch, call.length, *value.shape[2:])
    if isinstance(value, tuple):
        return tuple(_take(item, call, num_tokens) for item in value)
    return value


@contextmanager
def recording(recorder: StateRecorder) -> Iterator[None]:
    token = _RECORDING.set(recorder)
    try:
        yield
    finally:
        _RECORDING.reset(token)


def mixer_candidates(model: nn.Module, attention_modules: set[int]) -> list[nn.Module]:
    """Modules with a layer_idx whose forward takes a cache, that are no attention module and
    hold neither one nor another candidate (a decoder layer holds its mixer)."""
    found = [
        module
        for module in model.modules()
        if isinstance(getattr(module, "layer_idx", None), int)
        and id(module) not in attention_modules
        and any(name in _CACHE_PARAMETERS for name in inspect.signature(module.forward).parameters)
    ]
    inner = {id(module) for module in found} | attention_modules
    return [
        module
        for module in found
        if not any(id(child) in inner for child in module.modules() if child is not module)
    ]


@torch.inference_mode()
def probe_recurrent_layers(
    model: nn.Module, attention_modules: set[int], device: torch.device, num_tokens: int
) -> RecurrentLayers | None:
    """The model's recurrent mixers with their state layout, installed; None when it has none."""
    candidates = [SlotMixer(module) for module in mixer_candidates(model, attention_modules)]
    if not candidates:
        return None
    recorder = StateRecorder()
    for mixer in candidates:
        mixer.install()
    positions = torch.arange(num_tokens, device=device)[None, :]
    try:
        # Attention layers run as in the geometry probe: without a cache, over these tokens.
        with recording(recorder), probing({}):
            model(input_ids=torch.zeros_like(positions), position_ids=positions, use_cache=False)
    finally:
        for mixer in candidates:
            mixer.uninstall()
    stateful = {key.layer_idx for key in recorder.specs}
    mixers = {
        mixer.module.layer_idx: mixer
        for mixer in candidates
        if mixer.module.layer_idx in stateful and not mixer.not_recurrent
    }
    if not mixers:
        return None
    layers = RecurrentLayers(mixers=mixers, layout=StateLayout(dict(recorder.specs)))
    for mixer in mixers.values():
        mixer.owner = layers
        mixer.install()
    logger.info(
        "event=recurrent_layers layers=%d classes=%s state_bytes_per_sequence=%d",
        len(mixers),
        ",".join(sorted({type(mixer.module).__name__ for mixer in mixers.values()})),
        layers.layout.bytes_per_slot(),
    )
    return layers
