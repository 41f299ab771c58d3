"""Fewer, larger operations per decoder layer, for the Llama family on CPU in float32.

A decode step of a small model spends much of its time between operations rather than in them:
transformers' Llama layer runs three projections for Q, K and V, two for the MLP's gate and up,
RoPE as two separate seven-operation passes, and RMSNorm as six elementwise passes, each a
Python-level dispatch. This module replaces, in a loaded model, each Llama attention with one
packed QKV GEMM and one RoPE pass over Q and K together; each MLP with one packed gate-and-up
GEMM; each RMSNorm with one normalisation. With the C layer kernels (layer_kernels.py), RMSNorm,
RoPE and SiLU-times-up are one pass each; without them (no C compiler), torch's rms_norm and
in-place products. The arithmetic per element is transformers'; the logits equal the packed
path's to float32 rounding (tests/executor/test_fused_layers.py).

Only classes whose forward is known to compute exactly this are replaced; any other module
keeps transformers' own code. docs/cpu-executor.md ("Measured") has what it saves.
"""

from __future__ import annotations

import logging

import torch
import torch.nn.functional as F
from torch import nn
from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS
from transformers.models.llama.modeling_llama import eager_attention_forward

from executor_service.cpu_forward.packed_linear import PackedLinear
from executor_service.kernels.layer_kernels import LayerKernels
from executor_service.kernels.panel_linear import PanelKernel

logger = logging.getLogger(__name__)

# Classes whose forward is exactly: q/k/v projections, default RoPE from the model's
# position embeddings, attention, o_proj (no sliding window, no Q/K norms).
_ATTENTION_CLASSES = {"transformers.models.llama.modeling_llama.LlamaAttention"}
_MLP_CLASSES = {"transformers.models.llama.modeling_llama.LlamaMLP"}
_NORM_CLASSES = {"transformers.models.llama.modeling_llama.LlamaRMSNorm"}


def qualified_name(module: nn.Module) -> str:
    return f"{type(module).__module__}.{type(module).__qualname__}"


def _joined(linears: list[nn.Linear]) -> nn.Linear:
    """One linear layer computing the given ones side by side (outputs concatenated), for
    PackedLinear to pack; a missing bias is zeros beside a present one."""
    weight = torch.cat([linear.weight.detach() for linear in linears])
    joined = nn.Linear(weight.shape[1], weight.shape[0], bias=False, device="meta")
    joined.weight = nn.Parameter(weight, requires_grad=False)
    if any(linear.bias is not None for linear in linears):
        joined.bias = nn.Parameter(
            torch.cat([
                linear.bias.detach() if linear.bias is not None else weight.new_zeros(linear.out_features)
                for linear in linears
            ]),
            requires_grad=False,
        )
    return joined


def _rotated(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """transformers' apply_rotary_pos_emb for [tokens, heads, dim] against [tokens, 1, dim]."""
    half = x.shape[-1] // 2
    # In place on the fresh products: the same roundings, two fewer allocations and passes.
    return (x * cos).add_(torch.cat((-x[..., half:], x[..., :half]), dim=-1).mul_(sin))


class FusedAttention(nn.Module):
    """A Llama attention with Q, K and V from one packed GEMM and RoPE applied to Q and K in one
    pass. Attention is the function the model's config names, as in transformers: ours when
    serving, eager when the self-check computes its reference."""

    def __init__(self, attention: nn.Module, kernels: LayerKernels | None, panels: PanelKernel | None = None) -> None:
        super().__init__()
        self.kernels = kernels
        projections = [attention.q_proj, attention.k_proj, attention.v_proj]
        self.config = attention.config
        self.layer_idx = attention.layer_idx
        self.num_key_value_groups = attention.num_key_value_groups
        self.is_causal = attention.is_causal
        self.scaling = attention.scaling
        self.head_dim = attention.head_dim
        self.num_heads = attention.q_proj.out_features // self.head_dim
        self.num_kv_heads = attention.k_proj.out_features // self.head_dim
        self.qkv = PackedLinear(_joined(projections), panels)
        self.o_proj = PackedLinear(attention.o_proj, panels)

    def forward(
        self,
        hidden_states: torch.Tensor,
        position_embeddings: tuple[torch.Tensor, torch.Tensor],
        attention_mask: torch.Tensor | None = None,
        *,
        residual: torch.Tensor | None = None,
        **kwargs: object,
    ) -> tuple[torch.Tensor, None]:
        """residual: where the output is added, in place (lean_forward.py); transformers' layers
        add it themselves and pass none."""
        if kwargs.get("cache") is not None or kwargs.get("past_key_values") is not None:
            raise NotImplementedError(
                "fused layers run the executor's paged steps and keep no transformers cache; "
                "call the model with use_cache=False"
            )
        batch, tokens, _ = hidden_states.shape
        rows, heads, kv_heads, dim = batch * tokens, self.num_heads, self.num_kv_heads, self.head_dim
        qkv = self.qkv(hidden_states.reshape(rows, -1))
        cos, sin = (e.expand(batch, tokens, dim).reshape(rows, dim) for e in position_embeddings)
        qk = qkv[:, : (heads + kv_heads) * dim].view(rows, heads + kv_heads, dim)
        if self.kernels is not None:
            self.kernels.rope_(qk, cos, sin)
        else:
            qk = _rotated(qk, cos.unsqueeze(1), sin.unsqueeze(1))
        # Attention functions take transformers' [batch, heads, tokens, dim] views.
        query = qk[:, :heads].view(batch, tokens, heads, dim).transpose(1, 2)
        key = qk[:, heads:].view(batch, tokens, kv_heads, dim).transpose(1, 2)
        value = qkv[:, (heads + kv_heads) * dim :].view(batch, tokens, kv_heads, dim).transpose(1, 2)
        attend = ALL_ATTENTION_FUNCTIONS.get_interface(self.config._attn_implementation, eager_attention_forward)
        attended, _ = attend(self, query, key, value, attention_mask, dropout=0.0, scaling=self.scaling, **kwargs)
        return self.o_proj(attended.reshape(batch, tokens, -1), residual), None


class FusedMLP(nn.Module):
    """A SiLU-gated MLP with gate and up from one packed GEMM."""

    def __init__(self, mlp: nn.Module, kernels: LayerKernels | None, panels: PanelKernel | None = None) -> None:
        super().__init__()
        self.kernels = kernels
        self.intermediate = mlp.gate_proj.out_features
        self.gate_up = PackedLinear(_joined([mlp.gate_proj, mlp.up_proj]), panels)
        self.down_proj = PackedLinear(mlp.down_proj, panels)
        # SiLU-times-up in the gate-and-up GEMM's epilogue, where the panel kernel packs it: the
        # [tokens, 2 x intermediate] product is never written or read back.
        self.gated = self.gate_up.gated_width() == self.intermediate

    def forward(self, x: torch.Tensor, residual: torch.Tensor | None = None) -> torch.Tensor:
        """residual: where the output is added, in place (lean_forward.py)."""
        if self.gated:
            return self.down_proj(self.gate_up.silu_mul(x), residual)
        gate_up = self.gate_up(x)
        if self.kernels is not None:
            return self.down_proj(self.kernels.silu_mul(gate_up), residual)
        # mul_ into SiLU's fresh output: 2,048 rows of 1,408 take 1.6 ms instead of 2.2.
        hidden = F.silu(gate_up[..., : self.intermediate]).mul_(gate_up[..., self.intermediate :])
        return self.down_proj(hidden, residual)


class FusedRMSNorm(nn.Module):
    def __init__(self, norm: nn.Module, kernels: LayerKernels | None) -> None:
        super().__init__()
        self.kernels = kernels
        self.weight = norm.weight
        self.eps = norm.variance_epsilon

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.kernels is not None:
            return self.kernels.rms_norm(x, self.weight, self.eps)
        return torch.rms_norm(x, (x.shape[-1],), self.weight, self.eps)


def _fusable_mlp(mlp: nn.Module) -> bool:
    return (
        qualified_name(mlp) in _MLP_CLASSES
        and getattr(mlp.config, "hidden_act", None) == "silu"
        and all(type(getattr(mlp, name)) is nn.Linear for name in ("gate_proj", "up_proj", "down_proj"))
    )


def _fusable_attention(attention: nn.Module) -> bool:
    return qualified_name(attention) in _ATTENTION_CLASSES and all(
        type(getattr(attention, name)) is nn.Linear for name in ("q_proj", "k_proj", "v_proj", "o_proj")
    )


def fuse_layers(model: nn.Module, kernels: LayerKernels | None, panels: PanelKernel | None = None) -> int:
    """Replaces, in place, every fusable attention, MLP and RMSNorm of a float32 model whose
    linear layers are still plain; returns how many modules were replaced. Call before packing
    the remaining linear layers. kernels: the C passes, or None for torch's operations;
    panels: the panel linear kernel, or None for oneDNN."""
    replacements: list[tuple[nn.Module, str, nn.Module]] = []
    for parent in model.modules():
        for name, child in parent.named_children():
            if _fusable_attention(child):
                replacements.append((parent, name, FusedAttention(child, kernels, panels)))
            elif _fusable_mlp(child):
                replacements.append((parent, name, FusedMLP(child, kernels, panels)))
            elif qualified_name(child) in _NORM_CLASSES:
                replacements.append((parent, name, FusedRMSNorm(child, kernels)))
    for parent, name, fused in replacements:
        setattr(parent, name, fused)
    linears = [m for _, _, fused in replacements for m in fused.modules() if isinstance(m, PackedLinear)]
    logger.info(
        "event=layers_fused modules=%d elementwise=%s linears=%d four_bit_blocks=%d",
        len(replacements), "c" if kernels else "torch", len(linears), sum(m.blocks is not None for m in linears),
    )
    return len(replacements)
