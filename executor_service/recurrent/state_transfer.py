"""One state slot as bytes, for moving a request's recurrent state with its blocks
(KvBlockChunk.state).

The bytes of a slot are every state tensor of every recurrent layer, in StateKey order (layer,
kind, index), raw in the tensor's own dtype (SSM states are often float32 in a half-precision
model). Two executors whose state_layout_name strings are equal read each other's bytes the same
way; ExecutorInfo.kv_layout carries that name.
"""

from __future__ import annotations

import hashlib

import torch

from executor_service.recurrent.state_slots import StateKey, StateLayout, StateSlots


def state_order(layout: StateLayout) -> list[StateKey]:
    """The order the tensors travel in: fixed by the keys, not by which mixer the probe met first."""
    return sorted(layout.specs, key=lambda key: (key.layer_idx, key.kind, key.state_idx))


def state_layout_name(layout: StateLayout) -> str:
    """What the bytes of a slot depend on, for kv_layout: their size, and a digest of every
    tensor's key, shape and dtype (a list of them would make kv_layout as long as the model)."""
    described = ";".join(
        f"{key.layer_idx}/{key.kind}/{key.state_idx}:{'x'.join(map(str, spec.shape))}:{str(spec.dtype).removeprefix('torch.')}"
        for key in state_order(layout)
        for spec in (layout.specs[key],)
    )
    digest = hashlib.sha256(described.encode()).hexdigest()[:16]
    return f"state_bytes={layout.bytes_per_slot()} state={digest}"


def read_slot(states: StateSlots, slot: int) -> bytes:
    """The bytes of one slot's state."""
    # uint8 views: numpy has no bfloat16, and the tensors' dtypes differ.
    parts = [states.tensors[key][slot].reshape(-1).view(torch.uint8) for key in state_order(states.layout)]
    return torch.cat(parts).cpu().numpy().tobytes()


def write_slot(states: StateSlots, slot: int, data: bytes) -> None:
    """Writes read_slot's bytes into one slot; ValueError, writing nothing, when they are not one
    slot's worth."""
    order = state_order(states.layout)
    sizes = [states.layout.specs[key].nbytes() for key in order]
    if len(data) != sum(sizes):
        raise ValueError(f"{len(data)} bytes of recurrent state are not one slot's ({sum(sizes)} bytes)")
    device = states.tensors[order[0]].device
    # A writable copy: torch.frombuffer over immutable bytes warns, and the copy is the upload's anyway.
    flat = torch.frombuffer(bytearray(data), dtype=torch.uint8).to(device)
    for key, part in zip(order, flat.split(sizes), strict=True):
        spec = states.layout.specs[key]
        # clone(): a part that starts at an offset its dtype is not aligned to cannot be viewed as it.
        states.tensors[key][slot].copy_(part.clone().view(spec.dtype).view(spec.shape))
