"""Linear layers on CPU with weights packed once at start, through the C panel kernel
(panel_linear.py) where the CPU has AVX-512, else through oneDNN.

A decode step multiplies a few dozen rows by every weight matrix; for those skinny shapes the
default path (MKL sgemm on the plain [out, in] weight) reaches under half of what a packed
weight allows; the panel kernel runs ahead of oneDNN at decode sizes and even with it at
prefill sizes (docs/cpu-executor.md, "Measured", has the figures). vLLM's CPU backend and inductor's freezing pass
take the oneDNN route.

The packed copy replaces the plain weight: the module's `weight` becomes a meta tensor of the
same shape and dtype, so code that only asks a weight for its shape or dtype keeps working, and
code that would read its values fails loudly instead of reading stale numbers. Embeddings keep
their own weight, so a tied lm_head costs one packed copy of the vocabulary matrix.
"""

from __future__ import annotations

import logging

import torch
from torch import nn
from transformers.pytorch_utils import Conv1D

from executor_service.kernels.panel_linear import PanelKernel

logger = logging.getLogger(__name__)

# float32 kernels are what is measured; bf16 packing is fast only on CPUs with native bf16 and
# half precision is not packed at all.
PACKABLE_DTYPES = (torch.float32,)


class PackedLinear(nn.Module):
    """y = x W^T + b with W held in the panel kernel's layout, or oneDNN's where panels is None."""

    def __init__(self, linear: nn.Linear, panels: PanelKernel | None = None) -> None:
        super().__init__()
        self.in_features = linear.in_features
        self.out_features = linear.out_features
        weight = linear.weight.detach()
        self.panels = panels
        # The same weight as 4-bit blocks where it is made of them (panel_linear.py), else None.
        self.blocks: torch.Tensor | None = None
        if panels is not None:
            self.packed = panels.pack(weight)
            self.blocks = panels.pack_blocks(weight)
        else:
            self.packed = torch.ops.mkldnn._reorder_linear_weight(weight, None)
        self.bias = linear.bias
        # A plain attribute, not a parameter: model.parameters() (and with it transformers'
        # model.device) must not see a meta tensor.
        self.weight = torch.empty(weight.shape, dtype=weight.dtype, device="meta")

    def forward(self, x: torch.Tensor, residual: torch.Tensor | None = None) -> torch.Tensor:
        """x W^T + b; with a residual, (x W^T + b) + residual written into the residual, in place
        (by the panel kernel's epilogue, or one add_ after oneDNN), which is returned."""
        if self.panels is not None:
            return self.panels.linear(x, self.packed, self.out_features, self.bias, residual, self.blocks)
        out = torch.ops.mkldnn._linear_pointwise(x, self.packed, self.bias, "none", [], "")
        return out if residual is None else residual.add_(out)

    def gated_width(self) -> int | None:
        """For a joined [gate; up] weight: the width silu_mul gives, or None where the panel
        kernel cannot compute it in one pass (oneDNN packing, or halves not whole panels)."""
        width = self.out_features // 2
        if self.panels is None or self.out_features % 2 or width % self.panels.panel:
            return None
        return width

    def silu_mul(self, x: torch.Tensor) -> torch.Tensor:
        """silu(gate) * up of a joined [gate; up] weight, in one pass, where gated_width() says it
        can be (the panel kernel refuses halves that are not whole panels)."""
        if self.panels is None or self.out_features % 2:
            raise ValueError(f"{self.out_features} outputs packed for {self.extra_repr()} cannot be gated in one pass")
        return self.panels.linear_silu_mul(x, self.packed, self.out_features // 2, self.bias, self.blocks)

    def extra_repr(self) -> str:
        backend = "onednn" if self.panels is None else "panels+4-bit blocks" if self.blocks is not None else "panels"
        return f"in_features={self.in_features}, out_features={self.out_features}, packed={backend}"


def packing_available(device: torch.device, dtype: torch.dtype) -> bool:
    return (
        device.type == "cpu"
        and dtype in PACKABLE_DTYPES
        and torch.backends.mkldnn.is_available()
        and hasattr(torch.ops.mkldnn, "_reorder_linear_weight")
        and hasattr(torch.ops.mkldnn, "_linear_pointwise")
    )


def linear_from(weight: torch.Tensor, bias: torch.Tensor | None = None) -> nn.Linear:
    """The nn.Linear computing x weight^T + bias, for PackedLinear to pack; weight is [out, in]."""
    out_features, in_features = weight.shape
    linear = nn.Linear(in_features, out_features, bias=bias is not None, device="meta", dtype=weight.dtype)
    linear.weight = nn.Parameter(weight.detach().contiguous(), requires_grad=False)
    if bias is not None:
        linear.bias = bias if isinstance(bias, nn.Parameter) else nn.Parameter(bias.detach(), requires_grad=False)
    return linear


def as_linear(conv: Conv1D) -> nn.Linear:
    """GPT-2's Conv1D (x W + b, W stored [in, out]) as the nn.Linear it is. Packed like the
    others, it leaves MKL's plain GEMM, which gives a row other bits when a step has 1-3 rows
    than when it has 4 or more: the row's logits would depend on its batch."""
    return linear_from(conv.weight.t(), conv.bias)


def replace_with_meta(module: nn.Module, name: str) -> None:
    """Swaps a weight the packed copies replace for a meta tensor of its shape and dtype, as a
    plain attribute (PackedLinear says why), so its memory is freed and reads of it fail."""
    tensor = getattr(module, name)
    delattr(module, name)
    setattr(module, name, torch.empty(tensor.shape, dtype=tensor.dtype, device="meta"))


def pack_linears(model: nn.Module, panels: PanelKernel | None = None, keep: frozenset[int] = frozenset()) -> int:
    """Replaces every plain nn.Linear (and transformers' Conv1D) of the model in place; returns
    how many. panels: the panel kernel, or None for oneDNN. keep: id()s of linears to leave as
    they are (their weight is read by code other than their forward: PackedLinear has none).

    Subclasses of nn.Linear are left alone: they may change what forward computes.
    """
    targets = [
        (parent, name, child)
        for parent in model.modules()
        for name, child in parent.named_children()
        if type(child) in (nn.Linear, Conv1D) and child.weight.dtype in PACKABLE_DTYPES and id(child) not in keep
    ]
    packed: dict[int, PackedLinear] = {}
    for parent, name, child in targets:
        # A module reached by two paths is packed once and shared, as it was.
        replacement = packed.get(id(child))
        if replacement is None:
            linear = as_linear(child) if isinstance(child, Conv1D) else child
            replacement = packed[id(child)] = PackedLinear(linear, panels)
        setattr(parent, name, replacement)
    blocked = sum(linear.blocks is not None for linear in packed.values())
    logger.info(
        "event=linears_packed count=%d backend=%s four_bit_blocks=%d amx=%s",
        len(packed), "panels" if panels else "onednn", blocked, bool(panels and panels.amx),
    )
    return len(packed)
