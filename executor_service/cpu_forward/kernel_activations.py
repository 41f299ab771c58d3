"""Activations whose bits do not depend on the step (issue 35), for layers that are not fused.

torch computes an activation element inside its vectorised loop with other code than in the
loop's scalar tail, and where the tail falls, and where a thread's share starts, depends on the
tensor's size: with an intermediate width that is not a multiple of 16, or a thread count that
does not divide the step evenly, a row's SiLU, sigmoid or GELU came out with other last bits
alone than beside other rows. The C kernels (kernels/activations.c) compute each element with
the same operations wherever it lies.

Every activation module transformers' models hold (ACT2FN) whose function the kernels have is
replaced; ReLU and its square are exact in torch already, and the rarer ones (Mish, xIELU,
clipped or "accurate" GELU and the like) stay torch's. Two sigmoids sit inside methods rather
than modules, restated here with the kernel's: gpt-oss's experts' gate, and the gate on
Qwen2-MoE's shared expert.
"""

from __future__ import annotations

import enum
import logging
import types
from collections.abc import Callable

import torch
from torch import nn

from executor_service.cpu_forward.fused_layers import qualified_name
from executor_service.kernels.layer_kernels import LayerKernels

logger = logging.getLogger(__name__)


class Activation(enum.IntEnum):
    """kernels/activations.c's enum activation_kind."""

    SILU = 0
    SIGMOID = 1
    GELU_TANH = 2
    GELU_ERF = 3
    QUICK_GELU = 4


_BY_CLASS: dict[str, Activation] = {
    "torch.nn.modules.activation.SiLU": Activation.SILU,
    "transformers.activations.SiLUActivation": Activation.SILU,
    "torch.nn.modules.activation.Sigmoid": Activation.SIGMOID,
    "transformers.activations.GELUTanh": Activation.GELU_TANH,
    "transformers.activations.NewGELUActivation": Activation.GELU_TANH,
    "transformers.activations.FastGELUActivation": Activation.GELU_TANH,
    "transformers.activations.GELUActivation": Activation.GELU_ERF,
    "transformers.activations.QuickGELUActivation": Activation.QUICK_GELU,
}
_GPT_OSS_EXPERTS = "transformers.models.gpt_oss.modeling_gpt_oss.GptOssExperts"
_QWEN2_MOE_BLOCK = "transformers.models.qwen2_moe.modeling_qwen2_moe.Qwen2MoeSparseMoeBlock"


def activation_of(module: nn.Module) -> Activation | None:
    """The kernels' activation that `module` computes, or None where they have none."""
    if isinstance(module, nn.GELU):
        return Activation.GELU_TANH if module.approximate == "tanh" else Activation.GELU_ERF
    return _BY_CLASS.get(qualified_name(module))


class KernelActivation(nn.Module):
    def __init__(self, kind: Activation, kernels: LayerKernels) -> None:
        super().__init__()
        self.kind = kind
        self.kernels = kernels

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.kernels.activation(self.kind, x)

    def extra_repr(self) -> str:
        return self.kind.name.lower()


def _gpt_oss_gate(kernels: LayerKernels) -> Callable[[nn.Module, torch.Tensor], torch.Tensor]:
    def apply_gate(self: nn.Module, gate_up: torch.Tensor) -> torch.Tensor:
        """GptOssExperts._apply_gate: a clamped SwiGLU on interleaved gate and up, its sigmoid
        the kernel's."""
        gate = gate_up[..., ::2].clamp(min=None, max=self.limit)
        up = gate_up[..., 1::2].clamp(min=-self.limit, max=self.limit)
        glu = gate * kernels.activation(Activation.SIGMOID, gate * self.alpha)
        return (up + 1) * glu

    return apply_gate


def _qwen2_moe_forward(kernels: LayerKernels) -> Callable[[nn.Module, torch.Tensor], torch.Tensor]:
    def forward(self: nn.Module, hidden_states: torch.Tensor) -> torch.Tensor:
        """Qwen2MoeSparseMoeBlock.forward: routed experts plus the shared expert, scaled by the
        kernel's sigmoid of its gate."""
        batch, length, hidden = hidden_states.shape
        rows = hidden_states.view(-1, hidden)
        shared = self.shared_expert(rows)
        _, weights, selected = self.gate(rows)
        routed = self.experts(rows, selected, weights)
        shared = kernels.activation(Activation.SIGMOID, self.shared_expert_gate(rows)) * shared
        return (routed + shared).reshape(batch, length, hidden)

    return forward


def install_kernel_activations(model: nn.Module, kernels: LayerKernels) -> int:
    """Replaces, in place, every activation module of a float32 CPU model that the kernels
    compute, and the sigmoids of gpt-oss's expert gates and Qwen2-MoE's shared-expert gates;
    returns how many were replaced."""
    targets = [
        (parent, name, kind)
        for parent in model.modules()
        for name, child in parent.named_children()
        if (kind := activation_of(child)) is not None
    ]
    for parent, name, kind in targets:
        setattr(parent, name, KernelActivation(kind, kernels))
    gates = [module for module in model.modules() if qualified_name(module) in (_GPT_OSS_EXPERTS, _QWEN2_MOE_BLOCK)]
    for module in gates:
        if qualified_name(module) == _GPT_OSS_EXPERTS:
            module._apply_gate = types.MethodType(_gpt_oss_gate(kernels), module)
        else:
            module.forward = types.MethodType(_qwen2_moe_forward(kernels), module)
    logger.info("event=activations_installed modules=%d gates=%d", len(targets), len(gates))
    return len(targets) + len(gates)
