"""The executor's recurrent state: per recurrent layer, each state tensor the layer keeps (conv
window, SSM or linear-attention state) with one row per slot.

Slots are numbered 1..num_slots as the scheduler names them (NewRequest.state_slot); row 0 is in
no slot. A request's state is only ever read after its own first chunk wrote it (a new request
starts empty), so slots are not cleared between owners.
"""

from __future__ import annotations

import logging
import math
from dataclasses import dataclass

import torch

logger = logging.getLogger(__name__)

# The kinds of state transformers' cache interface keeps: a causal convolution's last inputs,
# an SSM / delta-rule state, and MiniMax's lightning-attention K^T V.
CONV, RECURRENT, LINEAR = "conv", "recurrent", "linear"


@dataclass(slots=True, frozen=True)
class StateKey:
    layer_idx: int
    kind: str
    state_idx: int


@dataclass(slots=True, frozen=True)
class StateSpec:
    """One state tensor of one sequence (no batch dimension), as the model's mixer produced it
    in a probe forward: SSM states are often float32 in a half-precision model."""

    shape: tuple[int, ...]
    dtype: torch.dtype

    def nbytes(self) -> int:
        return math.prod(self.shape) * torch.empty((), dtype=self.dtype).element_size()


@dataclass(slots=True, frozen=True)
class StateLayout:
    specs: dict[StateKey, StateSpec]

    @property
    def layers(self) -> tuple[int, ...]:
        return tuple(sorted({key.layer_idx for key in self.specs}))

    def bytes_per_slot(self) -> int:
        return sum(spec.nbytes() for spec in self.specs.values())


class StateSlots:
    def __init__(self, layout: StateLayout, num_slots: int, device: torch.device) -> None:
        if num_slots <= 0:
            raise ValueError(f"a model with recurrent layers needs at least one state slot, got {num_slots}")
        self.layout = layout
        self.num_slots = num_slots
        self.tensors = {
            key: torch.zeros(num_slots + 1, *spec.shape, dtype=spec.dtype, device=device)
            for key, spec in layout.specs.items()
        }
        self._by_layer: dict[int, list[StateKey]] = {}
        for key in layout.specs:
            self._by_layer.setdefault(key.layer_idx, []).append(key)
        logger.info(
            "event=state_slots_allocated slots=%d layers=%d bytes=%d device=%s",
            num_slots,
            len(layout.layers),
            num_slots * layout.bytes_per_slot(),
            device,
        )

    def read(self, key: StateKey, slots: torch.Tensor) -> torch.Tensor:
        """A copy of these slots' state, [len(slots), *shape]."""
        return self.tensors[key].index_select(0, slots)

    def write(self, key: StateKey, slots: torch.Tensor, values: torch.Tensor) -> None:
        tensor = self.tensors[key]
        tensor.index_copy_(0, slots, values.to(tensor.dtype))

    def copy_layer(self, layer_idx: int, source: int, destination: int) -> None:
        """Copies one layer's state of slot source into slot destination (a checkpoint, made
        layer by layer as the forward passes)."""
        for key in self._by_layer[layer_idx]:
            tensor = self.tensors[key]
            tensor[destination].copy_(tensor[source])

    def copy_slot(self, source: int, destination: int) -> None:
        """Copies every layer's state of slot source into slot destination (a request that
        resumes from a checkpoint)."""
        for tensor in self.tensors.values():
            tensor[destination].copy_(tensor[source])

    def wipe(self) -> None:
        for tensor in self.tensors.values():
            tensor.zero_()
