"""Linear layers on CPU through oneDNN with weights packed once at start.

A decode step multiplies a few dozen rows by every weight matrix; for those skinny shapes the
default path (MKL sgemm on the plain [out, in] weight) reaches under half of what oneDNN does
with a weight reordered once into its blocked layout (random Llama lm_head, 32 x 512 x 32000 on
two cores: 14.4 ms plain, 5.5 ms packed; an MLP projection 0.40 -> 0.23 ms). vLLM's CPU
backend and inductor's freezing pass take the same route.

The packed copy replaces the plain weight: the module's `weight` becomes a meta tensor of the
same shape and dtype, so code that only asks a weight for its shape or dtype keeps working, and
code that would read its values fails loudly instead of reading stale numbers. Embeddings keep
their own weight, so a tied lm_head costs one packed copy of the vocabulary matrix.
"""

from __future__ import annotations

import logging

import torch
from torch import nn

logger = logging.getLogger(__name__)

# oneDNN's fp32 kernels are what is measured; bf16 packing is fast only on CPUs with native
# bf16 and half precision is not packed at all.
PACKABLE_DTYPES = (torch.float32,)


class PackedLinear(nn.Module):
    """y = x W^T + b with W held in oneDNN's packed layout."""

    def __init__(self, linear: nn.Linear) -> None:
        super().__init__()
        self.in_features = linear.in_features
        self.out_features = linear.out_features
        weight = linear.weight.detach()
        self.packed = torch.ops.mkldnn._reorder_linear_weight(weight, None)
        self.bias = linear.bias
        # A plain attribute, not a parameter: model.parameters() (and with it transformers'
        # model.device) must not see a meta tensor.
        self.weight = torch.empty(weight.shape, dtype=weight.dtype, device="meta")

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.ops.mkldnn._linear_pointwise(x, self.packed, self.bias, "none", [], "")

    def extra_repr(self) -> str:
        return f"in_features={self.in_features}, out_features={self.out_features}, packed=onednn"


def packing_available(device: torch.device, dtype: torch.dtype) -> bool:
    return (
        device.type == "cpu"
        and dtype in PACKABLE_DTYPES
        and torch.backends.mkldnn.is_available()
        and hasattr(torch.ops.mkldnn, "_reorder_linear_weight")
        and hasattr(torch.ops.mkldnn, "_linear_pointwise")
    )


def pack_linears(model: nn.Module) -> int:
    """Replaces every plain nn.Linear of the model in place; returns how many.

    Subclasses of nn.Linear are left alone: they may change what forward computes.
    """
    targets = [
        (parent, name, child)
        for parent in model.modules()
        for name, child in parent.named_children()
        if type(child) is nn.Linear and child.weight.dtype in PACKABLE_DTYPES
    ]
    packed: dict[int, PackedLinear] = {}
    for parent, name, child in targets:
        # A module reached by two paths is packed once and shared, as it was.
        replacement = packed.get(id(child))
        if replacement is None:
            replacement = packed[id(child)] = PackedLinear(child)
        setattr(parent, name, replacement)
    logger.info("event=linears_packed count=%d backend=onednn", len(packed))
    return len(packed)
