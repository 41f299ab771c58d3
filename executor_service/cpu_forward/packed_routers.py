"""Mixture-of-experts routers whose logits come from a packed linear.

A router's logits are one GEMM over the whole step, which MKL's plain GEMM computes with other
bits for a row when the step has a single row: a sequence decoding alone would be routed with
other weights than beside others (issue 35). Packed, the logits of a row are the same bits
whatever the step; what the router does with them is per row already.

Only routers whose forward is known are replaced; the rest of each one's forward (choosing the
top-k experts and their weights from the logits) is transformers' own, restated per class.
"""

from __future__ import annotations

import logging
from collections.abc import Callable

import torch
import torch.nn.functional as F
from torch import nn

from executor_service.cpu_forward.fused_layers import qualified_name
from executor_service.cpu_forward.packed_linear import (
    PACKABLE_DTYPES,
    PackedLinear,
    linear_from,
    replace_with_meta,
)
from executor_service.kernels.panel_linear import PanelKernel

logger = logging.getLogger(__name__)

# (router, logits [tokens, experts]) -> (weights, indices), both [tokens, top_k].
Routing = Callable[[nn.Module, torch.Tensor], tuple[torch.Tensor, torch.Tensor]]


def _softmax_of_top_k(router: nn.Module, logits: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """GptOssTopKRouter's: a softmax over the top-k logits."""
    top, indices = torch.topk(logits, router.top_k, dim=-1)
    return F.softmax(top, dim=1, dtype=top.dtype), indices


def _top_k_of_softmax(router: nn.Module, logits: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Qwen3MoeTopKRouter's: the top-k of a softmax over all experts, renormalized if asked."""
    probabilities = F.softmax(logits, dtype=torch.float, dim=-1)
    top, indices = torch.topk(probabilities, router.top_k, dim=-1)
    if router.norm_topk_prob:
        top /= top.sum(dim=-1, keepdim=True)
    return top.to(logits.dtype), indices


def _renormalized_top_k_of_softmax(router: nn.Module, logits: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """MixtralTopKRouter's: the top-k of a softmax over all experts, always renormalized."""
    probabilities = F.softmax(logits.float(), dim=-1)
    top, indices = torch.topk(probabilities, router.top_k, dim=-1)
    top /= top.sum(dim=-1, keepdim=True)
    return top, indices


def _sigmoid(logits: torch.Tensor) -> torch.Tensor:
    """sigmoid(x) as the first of softmax([x, 0]). torch's sigmoid gives an element other bits in
    the scalar tail of its vectorized loop than in the loop, and which elements fall in the tail
    depends on the step's size (a step of one row has only tail); softmax over the last
    dimension runs every row, here every pair, through the same code."""
    return torch.stack((logits, torch.zeros_like(logits)), dim=-1).softmax(dim=-1)[..., 0]


def _grouped_sigmoid_top_k(router: nn.Module, logits: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """DeepseekV3TopkRouter's: sigmoid scores, the top-k among the best groups of experts
    (chosen with the correction bias), weights renormalized if asked and scaled."""
    per_group = router.num_experts // router.num_group
    scores = _sigmoid(logits)
    for_choice = scores + router.e_score_correction_bias
    group_scores = for_choice.view(-1, router.num_group, per_group).topk(2, dim=-1)[0].sum(dim=-1)
    groups = torch.topk(group_scores, k=router.topk_group, dim=-1, sorted=False)[1]
    group_mask = torch.zeros_like(group_scores).scatter_(1, groups, 1)
    score_mask = group_mask.unsqueeze(-1).expand(-1, router.num_group, per_group).reshape(-1, router.num_experts)
    for_choice = for_choice.masked_fill(~score_mask.bool(), float("-inf"))
    indices = torch.topk(for_choice, k=router.top_k, dim=-1, sorted=False)[1]
    weights = scores.gather(1, indices)
    if router.norm_topk_prob:
        weights /= weights.sum(dim=-1, keepdim=True) + 1e-20
    return weights * router.routed_scaling_factor, indices



def _router(model_type: str, name: str) -> str:
    return f"transformers.models.{model_type}.modeling_{model_type}.{name}"


# Each class's forward was read and found to be the routing named (transformers 5.24).
_ROUTINGS: dict[str, Routing] = {
    _router("gpt_oss", "GptOssTopKRouter"): _softmax_of_top_k,
    **{
        _router(model_type, name): _top_k_of_softmax
        for model_type, name in (
            ("qwen3_moe", "Qwen3MoeTopKRouter"),
            ("qwen2_moe", "Qwen2MoeTopKRouter"),
            ("olmoe", "OlmoeTopKRouter"),
            ("flex_olmo", "FlexOlmoTopKRouter"),
        )
    },
    _router("mixtral", "MixtralTopKRouter"): _renormalized_top_k_of_softmax,
    _router("deepseek_v3", "DeepseekV3TopkRouter"): _grouped_sigmoid_top_k,
}


class PackedRouter(nn.Module):
    """A router with its logits from a packed linear; returns what it returned: (logits,
    weights, indices). The original router is kept for its settings; its weight is meta."""

    def __init__(self, router: nn.Module, routing: Routing, panels: PanelKernel | None = None) -> None:
        super().__init__()
        bias = getattr(router, "bias", None)
        self.logits = PackedLinear(linear_from(router.weight, bias), panels)
        replace_with_meta(router, "weight")
        if bias is not None:
            replace_with_meta(router, "bias")
        self.router = router
        self.routing = routing

    def forward(self, hidden_states: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        logits = self.logits(hidden_states.reshape(-1, self.logits.in_features))
        weights, indices = self.routing(self.router, logits)
        return logits, weights, indices


def _packable(router: nn.Module) -> bool:
    weight = getattr(router, "weight", None)
    return qualified_name(router) in _ROUTINGS and isinstance(weight, torch.Tensor) and weight.dtype in PACKABLE_DTYPES


def pack_routers(model: nn.Module, panels: PanelKernel | None = None) -> int:
    """Replaces, in place, every known router of a float32 model with a PackedRouter; returns
    how many. panels: the panel kernel, or None for oneDNN."""
    targets = [
        (parent, name, child)
        for parent in model.modules()
        for name, child in parent.named_children()
        if _packable(child)
    ]
    for parent, name, router in targets:
        setattr(parent, name, PackedRouter(router, _ROUTINGS[qualified_name(router)], panels))
    logger.info("event=routers_packed count=%d backend=%s", len(targets), "panels" if panels else "onednn")
    return len(targets)
