"""The forward of a fused Llama without transformers' per-call machinery.

transformers' LlamaForCausalLM runs every call through decorators (deprecate_kwarg,
merge_with_config_defaults, capture_outputs, can_return_tuple), builds a causal mask that paged
attention never reads, hands keyword arguments down three calls deep in every decoder layer (whose
forward is decorated too) and wraps its outputs in dataclasses: a few percent of a small
model's decode step (docs/cpu-executor.md, "Measured").

Where fuse_layers replaced every attention, MLP and RMSNorm of a LlamaForCausalLM, LeanLlama
computes what LlamaModel.forward and LlamaDecoderLayer.forward do, in their order: the embedding,
the rotary tables, then per layer h = h + attention(norm(h)) and h = h + mlp(norm(h)), each sum
written into h by the o_proj and down_proj GEMMs (the same sum: IEEE addition commutes), then the
final norm over the rows whose logits are kept (RMSNorm is per row) and the head. Pure decode
steps run the layer loop as one C call where every layer is on the C kernels (decode_program.py).
The start-up self-check compares its logits with transformers' own forward, as it does for any
model.
"""

from __future__ import annotations

import torch
from torch import nn

from executor_service.attention.attention_metadata import StepAttention
from executor_service.attention.paged_attention import STEP_KWARG
from executor_service.cpu_forward.decode_program import decode_program
from executor_service.cpu_forward.fused_layers import (
    FusedAttention,
    FusedMLP,
    FusedRMSNorm,
    qualified_name,
)

_CAUSAL_LM = "transformers.models.llama.modeling_llama.LlamaForCausalLM"
_MODEL = "transformers.models.llama.modeling_llama.LlamaModel"
_DECODER_LAYER = "transformers.models.llama.modeling_llama.LlamaDecoderLayer"
_ROTARY = "transformers.models.llama.modeling_llama.LlamaRotaryEmbedding"


class LeanLlama:
    """Logits of a step from a fused LlamaForCausalLM; build with lean_llama()."""

    def __init__(self, model: nn.Module) -> None:
        inner = model.model
        self.embed_tokens: nn.Embedding = inner.embed_tokens
        self.rotary_emb: nn.Module = inner.rotary_emb
        self.layers: list[tuple[FusedRMSNorm, FusedAttention, FusedRMSNorm, FusedMLP]] = [
            (layer.input_layernorm, layer.self_attn, layer.post_attention_layernorm, layer.mlp)
            for layer in inner.layers
        ]
        self.norm: FusedRMSNorm = inner.norm
        self.head: nn.Module = model.lm_head
        # Pure decode steps' layers in one C call where every layer runs on the C kernels.
        self.program = decode_program(self.layers)

    def logits(
        self, input_ids: torch.Tensor, position_ids: torch.Tensor, step: StepAttention, logits_indices: torch.Tensor
    ) -> torch.Tensor:
        """[1, kept rows, vocab] logits of the [1, tokens] step at logits_indices, under
        torch.inference_mode() (compute_logits's). Modules are called through forward(): none of
        them has hooks, and __call__'s checks cost ~5 us each."""
        hidden = self.embed_tokens.forward(input_ids)
        position_embeddings = self.rotary_emb.forward(hidden, position_ids)
        if self.program is not None and self.program.covers(step):
            self.program.run(hidden, position_embeddings, step)
            return self.head(self.norm.forward(hidden[:, logits_indices]))
        attention_kwargs = {STEP_KWARG: step}
        for input_norm, attention, post_norm, mlp in self.layers:
            normed = input_norm.forward(hidden)
            attention.forward(normed, position_embeddings, None, residual=hidden, **attention_kwargs)
            mlp.forward(post_norm.forward(hidden), residual=hidden)
        return self.head(self.norm.forward(hidden[:, logits_indices]))


def lean_llama(model: nn.Module) -> LeanLlama | None:
    """A LeanLlama for a LlamaForCausalLM whose every layer fuse_layers replaced; None for any
    other model, which keeps transformers' forward."""
    inner = getattr(model, "model", None)
    if qualified_name(model) != _CAUSAL_LM or inner is None or qualified_name(inner) != _MODEL:
        return None
    layers = list(inner.layers)
    if len(layers) != model.config.num_hidden_layers or qualified_name(inner.rotary_emb) != _ROTARY:
        return None
    if type(inner.embed_tokens) is not nn.Embedding or type(inner.norm) is not FusedRMSNorm:
        return None
    for layer in layers:
        if qualified_name(layer) != _DECODER_LAYER:
            return None
        parts = (layer.input_layernorm, layer.self_attn, layer.post_attention_layernorm, layer.mlp)
        if tuple(type(part) for part in parts) != (FusedRMSNorm, FusedAttention, FusedRMSNorm, FusedMLP):
            return None
    return LeanLlama(model)
