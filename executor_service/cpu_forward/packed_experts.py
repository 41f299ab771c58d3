"""Mixture-of-experts layers whose rows do not depend on the rest of the step (issue 35).

transformers keeps a model's experts as 3D weights ([experts, out, in], or [experts, in, out]
where transposed) and multiplies each expert's share of the step's tokens with one GEMM. How many
rows an expert gets depends on every sequence in the step, and MKL's plain GEMM gives a row other
bits with 1-3 rows than with 4 or more, so a sequence's logits depended on its batch. Here each
expert's projections are PackedLinears, whose rows get the same bits alone as among 40 (the
packed path every dense layer takes), and each token's experts are summed in its top-k slot
order, which the router fixes from that token alone.

The computation is registered with transformers' ExpertsInterface and chosen for the model, so
the experts modules keep their own gating (gpt-oss's clamped, interleaved SwiGLU among others),
activation and post-expert norm; only their products move to the packed weights.
"""

from __future__ import annotations

import logging

import torch
from torch import nn
from transformers import PreTrainedModel
from transformers.integrations.moe import ExpertsInterface

from executor_service.cpu_forward.packed_linear import (
    PACKABLE_DTYPES,
    PackedLinear,
    linear_from,
    replace_with_meta,
)
from executor_service.kernels.panel_linear import PanelKernel

logger = logging.getLogger(__name__)

EXPERTS_NAME = "splitserve_packed"
# What @use_experts_implementation sets on an experts module: the contract this code computes.
_EXPERTS_FLAGS = ("has_gate", "has_bias", "is_transposed", "has_post_expert_norm", "_is_expert_parallel")


class ExpertLinears(nn.Module):
    """Each expert's first projection (gate-and-up, or up alone) and down projection, packed."""

    def __init__(self, up: list[PackedLinear], down: list[PackedLinear]) -> None:
        super().__init__()
        self.up = nn.ModuleList(up)
        self.down = nn.ModuleList(down)


def packed_experts_forward(
    self: nn.Module,
    hidden_states: torch.Tensor,
    top_k_index: torch.Tensor,
    top_k_weights: torch.Tensor,
) -> torch.Tensor:
    """transformers' experts computation ([tokens, hidden] in and out) on the packed weights."""
    linears: ExpertLinears = self.packed_experts
    tokens, top_k = top_k_index.shape
    slots = top_k_index.reshape(-1)
    # Each expert's (token, slot) pairs side by side; which rows share a product depends on the
    # step, but no row's bits do.
    order = torch.argsort(slots, stable=True)
    counts = torch.bincount(slots, minlength=len(linears.up)).tolist()
    grouped = hidden_states[order // top_k].split(counts)
    products = []
    for expert, rows in enumerate(grouped):
        if not rows.shape[0]:
            continue
        projected = linears.up[expert](rows)
        projected = self._apply_gate(projected) if self.has_gate else self.act_fn(projected)
        out = linears.down[expert](projected)
        products.append(self.post_expert_norm(out) if self.has_post_expert_norm else out)
    outputs = hidden_states.new_empty(tokens * top_k, hidden_states.shape[-1])
    outputs.index_copy_(0, order, torch.cat(products))
    weighted = outputs.view(tokens, top_k, -1) * top_k_weights.unsqueeze(-1)
    # Slot by slot, not a reduction over the slot axis: each token's sum is then the same chain
    # of additions whatever the step's shape.
    total = weighted[:, 0].clone()
    for slot in range(1, top_k):
        total += weighted[:, slot]
    return total.to(hidden_states.dtype)


def register_packed_experts() -> None:
    ExpertsInterface.register(EXPERTS_NAME, packed_experts_forward)


def _first_projection(module: nn.Module) -> str:
    return "gate_up_proj" if module.has_gate else "up_proj"


def _is_experts(module: nn.Module) -> bool:
    return all(hasattr(module, flag) for flag in _EXPERTS_FLAGS)


def _packable(module: nn.Module) -> bool:
    """Not sharded over ranks, and both projections 3D weights of a packable dtype."""
    if module._is_expert_parallel:
        return False
    weights = [getattr(module, name, None) for name in (_first_projection(module), "down_proj")]
    return all(
        isinstance(weight, torch.Tensor) and weight.dim() == 3 and weight.dtype in PACKABLE_DTYPES
        for weight in weights
    )


def _packed_per_expert(module: nn.Module, name: str, panels: PanelKernel | None) -> list[PackedLinear]:
    """One PackedLinear per expert of the 3D weight `name` (and its bias where the module has
    them); the 3D weight and bias become meta tensors."""
    weight = getattr(module, name).detach()
    bias = getattr(module, f"{name}_bias").detach() if module.has_bias else None
    linears = [
        PackedLinear(
            linear_from(
                expert.t() if module.is_transposed else expert, None if bias is None else bias[index]
            ),
            panels,
        )
        for index, expert in enumerate(weight)
    ]
    replace_with_meta(module, name)
    if bias is not None:
        replace_with_meta(module, f"{name}_bias")
    return linears


def pack_experts(model: PreTrainedModel, panels: PanelKernel | None = None) -> int:
    """Moves every experts module of a float32 model onto per-expert packed linears and selects
    their computation for the model; returns how many modules. panels: the panel kernel, or
    None for oneDNN. A model with an experts module that cannot be packed keeps transformers'
    computation for all of them, since the choice is the model's, not the module's."""
    experts = [module for module in model.modules() if _is_experts(module)]
    if not experts:
        return 0
    if not all(_packable(module) for module in experts):
        logger.info("event=experts_packed count=0 reason='an experts module is sharded or not float32'")
        return 0
    register_packed_experts()
    previous = model.get_experts_implementation()
    model.set_experts_implementation(EXPERTS_NAME)
    if any(module.config._experts_implementation != EXPERTS_NAME for module in experts):
        logger.info("event=experts_packed count=0 reason='transformers cannot set the experts implementation'")
        model.set_experts_implementation(previous)
        return 0
    for module in experts:
        module.packed_experts = ExpertLinears(
            _packed_per_expert(module, _first_projection(module), panels),
            _packed_per_expert(module, "down_proj", panels),
        )
    logger.info(
        "event=experts_packed count=%d experts=%d backend=%s",
        len(experts), sum(len(module.packed_experts.up) for module in experts), "panels" if panels else "onednn",
    )
    return len(experts)
