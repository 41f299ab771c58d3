"""Our attention function, registered with transformers' AttentionInterface.

Every layer of the model calls it with post-RoPE query/key/value of the whole flattened step
([1, heads, tokens, head_dim]); it writes the new K/V into the paged cache and attends each
sequence's new queries over that sequence's cached blocks. The step's metadata arrives as the
`splitserve_step` keyword, which transformers forwards from model(**kwargs) down to attention, so
no state is held here.
"""

from __future__ import annotations

import importlib.util
from typing import Any

import torch
import torch.nn.functional as F
from transformers import AttentionInterface

from executor_service.attention_metadata import DecodeAttention, StepAttention
from executor_service.kv_cache import PagedKVCache

ATTENTION_NAME = "splitserve_paged"
STEP_KWARG = "splitserve_step"


def register_paged_attention() -> None:
    AttentionInterface.register(ATTENTION_NAME, paged_attention_forward)


# flash-attn kernels exist only for half precision; float32 runs through SDPA.
FLASH_ATTN_DTYPES = (torch.float16, torch.bfloat16)


def select_backend(device: torch.device, dtype: torch.dtype) -> str:
    if (
        device.type == "cuda"
        and dtype in FLASH_ATTN_DTYPES
        and importlib.util.find_spec("flash_attn") is not None
    ):
        return "flash_attn"
    return "sdpa"


def paged_attention_forward(
    module: torch.nn.Module,
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    attention_mask: torch.Tensor | None,
    scaling: float | None = None,
    dropout: float = 0.0,
    sliding_window: int | None = None,
    softcap: float | None = None,
    **kwargs: Any,
) -> tuple[torch.Tensor, None]:
    step: StepAttention | None = kwargs.get(STEP_KWARG)
    if step is None:
        raise RuntimeError(f"{ATTENTION_NAME} attention needs the {STEP_KWARG} keyword")
    if softcap is not None:
        raise NotImplementedError("attention logit softcapping is not supported")
    key_cache, value_cache = step.kv_cache.layer(module.layer_idx)
    # [1, heads, tokens, dim] -> [tokens, heads, dim]: the cache and kernels are token-major.
    q = query[0].transpose(0, 1)
    key_cache.index_copy_(0, step.slot_mapping, key[0].transpose(0, 1).to(key_cache.dtype))
    value_cache.index_copy_(0, step.slot_mapping, value[0].transpose(0, 1).to(value_cache.dtype))
    if step.backend == "flash_attn":
        out = _flash_varlen(q, key_cache, value_cache, step, scaling, sliding_window)
    else:
        out = _sdpa(q, key_cache, value_cache, step, scaling, sliding_window)
    return out.unsqueeze(0), None


def _sdpa(
    q: torch.Tensor,
    key_cache: torch.Tensor,
    value_cache: torch.Tensor,
    step: StepAttention,
    scaling: float | None,
    window: int | None,
) -> torch.Tensor:
    out = torch.empty_like(q)
    for seq in step.prefills:
        # [heads, new, dim] against [kv_heads, context, dim]
        queries = q[seq.token_start : seq.token_end].transpose(0, 1)
        keys = key_cache[seq.kv_slots].transpose(0, 1)
        values = value_cache[seq.kv_slots].transpose(0, 1)
        mask = seq.mask(window)
        attended = F.scaled_dot_product_attention(
            queries,
            keys,
            values,
            attn_mask=mask,
            is_causal=mask is None,
            scale=scaling,
            enable_gqa=True,
        )
        out[seq.token_start : seq.token_end] = attended.transpose(0, 1)
    decodes = step.decodes
    if decodes is not None:
        attended = _sdpa_decode(q, key_cache, value_cache, decodes, step.kv_cache, scaling, window)
        out[decodes.token_index] = attended
    return out


def _sdpa_decode(
    q: torch.Tensor,
    key_cache: torch.Tensor,
    value_cache: torch.Tensor,
    decodes: DecodeAttention,
    kv_cache: PagedKVCache,
    scaling: float | None,
    window: int | None,
) -> torch.Tensor:
    """[batch, heads, dim] attention of every decode token over its padded context."""
    batch, kv_heads, dim = decodes.batch_size, key_cache.shape[1], key_cache.shape[2]
    keys, values = kv_cache.gather_buffers((batch, kv_heads, decodes.max_context, dim))
    # Row-wise gathers straight into [batch, kv_heads, context, dim] (see DecodeAttention).
    torch.index_select(key_cache.view(-1, dim), 0, decodes.gather_index, out=keys.view(-1, dim))
    torch.index_select(
        value_cache.view(-1, dim), 0, decodes.gather_index, out=values.view(-1, dim)
    )
    # Grouped-query attention without repeating K/V: the query heads sharing a KV head (heads
    # are grouped consecutively, as in transformers' repeat_kv) become that head's query rows.
    queries = q[decodes.token_index].reshape(batch, kv_heads, -1, dim)
    attended = F.scaled_dot_product_attention(
        queries, keys, values, attn_mask=decodes.mask(window), scale=scaling
    )
    return attended.view(batch, -1, dim)


def _flash_varlen(
    q: torch.Tensor,
    key_cache: torch.Tensor,
    value_cache: torch.Tensor,
    step: StepAttention,
    scaling: float | None,
    window: int | None,
) -> torch.Tensor:
    from flash_attn import flash_attn_varlen_func

    varlen = step.varlen
    if varlen is None:
        raise RuntimeError("flash_attn backend without varlen metadata")
    # Causal masking in flash-attn aligns the query block to the end of the keys, which is
    # exactly "new tokens follow the cached ones".
    return flash_attn_varlen_func(
        q,
        key_cache[varlen.kv_slots],
        value_cache[varlen.kv_slots],
        cu_seqlens_q=varlen.cu_seqlens_q,
        cu_seqlens_k=varlen.cu_seqlens_k,
        max_seqlen_q=varlen.max_seqlen_q,
        max_seqlen_k=varlen.max_seqlen_k,
        softmax_scale=scaling,
        causal=True,
        window_size=(window - 1, 0) if window is not None else (-1, -1),
    )
