"""What a recurrent mixer is handed as its `cache` for one call: the state of that call's
sequences, read from their slots, and written back when the call is done.

It answers the part of transformers' cache interface that mixers use (get/update conv and
recurrent states, as DynamicCache's linear-attention layers do, and MiniMax's linear cache) with
the same semantics, so the model's own mixer code runs unchanged.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from executor_service.recurrent.state_slots import (
    CONV,
    LINEAR,
    RECURRENT,
    StateKey,
    StateSlots,
    StateSpec,
)


class SlotStates:
    """The cache of one mixer call over `slots`; continuing: they hold state from earlier tokens
    (else the call starts from empty state, as a fresh cache does)."""

    def __init__(self, states: StateSlots, slots: torch.Tensor, continuing: bool) -> None:
        self._states = states
        self._slots = slots
        self._continuing = continuing
        # The state as this call left it (read, updated in place, or replaced), to write back.
        self._held: dict[StateKey, torch.Tensor] = {}

    def _get(self, key: StateKey) -> torch.Tensor | None:
        if not self._continuing:
            return self._held.get(key)
        if key not in self._held:
            self._held[key] = self._states.read(key, self._slots)
        return self._held[key]

    def _width(self, key: StateKey, conv_states: torch.Tensor, conv_kernel_size: int | None) -> int:
        return self._states.layout.specs[key].shape[-1]

    def get_conv_state(self, layer_idx: int, state_idx: int = 0) -> torch.Tensor | None:
        return self._get(StateKey(layer_idx, CONV, state_idx))

    def get_recurrent_state(self, layer_idx: int, state_idx: int = 0) -> torch.Tensor | None:
        return self._get(StateKey(layer_idx, RECURRENT, state_idx))

    def get_linear_cache(self, layer_idx: int) -> torch.Tensor | None:
        return self._get(StateKey(layer_idx, LINEAR, 0))

    def has_previous_state(self, layer_idx: int | None = None, state_idx: int | None = None) -> bool:
        return self._continuing

    def is_recording_past(self, layer_idx: int) -> bool:
        return False

    def update_conv_state(
        self,
        conv_states: torch.Tensor,
        layer_idx: int,
        state_idx: int = 0,
        conv_kernel_size: int | None = None,
        **kwargs: object,
    ) -> torch.Tensor:
        """The new inputs with the window of earlier ones before them (zeros for a sequence that
        starts here and is shorter than the window); keeps the last window's worth."""
        key = StateKey(layer_idx, CONV, state_idx)
        width = self._width(key, conv_states, conv_kernel_size)
        previous = self._get(key)
        if previous is None:
            full = conv_states
            if full.shape[-1] < width:
                full = F.pad(full, (width - full.shape[-1], 0))
        else:
            full = torch.cat([previous.to(conv_states.dtype), conv_states], dim=-1)
        self._held[key] = full[..., -width:]
        return full

    def update_recurrent_state(
        self, recurrent_states: torch.Tensor, layer_idx: int, state_idx: int = 0, **kwargs: object
    ) -> torch.Tensor:
        self._held[StateKey(layer_idx, RECURRENT, state_idx)] = recurrent_states
        return recurrent_states

    def set_linear_cache(self, layer_idx: int, linear_cache: torch.Tensor) -> None:
        self._held[StateKey(layer_idx, LINEAR, 0)] = linear_cache

    def commit(self) -> None:
        """Writes the call's state back into its slots."""
        for key, value in self._held.items():
            self._states.write(key, self._slots, value)


class StateRecorder(SlotStates):
    """The cache of a probe forward over one whole sequence: records the shape and dtype of
    each state the mixers keep, and stores nothing."""

    def __init__(self) -> None:
        self.specs: dict[StateKey, StateSpec] = {}
        self._held = {}
        self._continuing = False

    def _width(self, key: StateKey, conv_states: torch.Tensor, conv_kernel_size: int | None) -> int:
        width = conv_kernel_size or conv_states.shape[-1]
        self.specs[key] = StateSpec((*conv_states.shape[1:-1], width), conv_states.dtype)
        return width

    def update_recurrent_state(
        self, recurrent_states: torch.Tensor, layer_idx: int, state_idx: int = 0, **kwargs: object
    ) -> torch.Tensor:
        key = StateKey(layer_idx, RECURRENT, state_idx)
        self.specs[key] = StateSpec(tuple(recurrent_states.shape[1:]), recurrent_states.dtype)
        return recurrent_states

    def set_linear_cache(self, layer_idx: int, linear_cache: torch.Tensor) -> None:
        key = StateKey(layer_idx, LINEAR, 0)
        self.specs[key] = StateSpec(tuple(linear_cache.shape[1:]), linear_cache.dtype)

    def commit(self) -> None:
        """Nothing is kept."""
