"""Our attention function, registered with transformers' AttentionInterface.

Every layer of the model calls it with post-RoPE query/key/value of the whole flattened step
([1, heads, tokens, head_dim]); it writes the new K/V into the paged cache and attends each
sequence's new queries over that sequence's cached blocks.

The step's metadata reaches it two ways. transformers forwards extra model(**kwargs) down to
attention, so it arrives as the `splitserve_step` keyword in most models; some decoder layers do
not pass keywords on, and for those the forward runs inside `active_step`, a context variable
that lives for that one call on that one thread, so no state outlives the step.
"""

from __future__ import annotations

import importlib.util
import logging
from collections.abc import Iterator
from contextlib import contextmanager
from contextvars import ContextVar
from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F
from transformers import AttentionInterface

from executor_service.attention.attention_math import explicit_attention
from executor_service.attention.attention_metadata import (
    DecodeAttention,
    PagedDecode,
    StepAttention,
)
from executor_service.attention.decode_kernel import load_decode_kernel
from executor_service.attention.kv_cache import PagedKVCache
from executor_service.attention.prefill_kernel import load_prefill_kernel
from executor_service.kernels.cpu_kernels import KernelUnavailable, load_kernel_library

logger = logging.getLogger(__name__)

ATTENTION_NAME = "splitserve_paged"
STEP_KWARG = "splitserve_step"

@dataclass(slots=True, frozen=True)
class LayerGeometry:
    """What one attention layer stores per token: its K/V heads and their widths."""

    num_kv_heads: int
    key_dim: int
    value_dim: int


@dataclass(slots=True, frozen=True)
class ProbedLayer:
    """What a probe forward saw of one attention layer."""

    geometry: LayerGeometry
    # transformers marks bidirectional attention (encoders) with is_causal = False.
    causal: bool
    # id() of the attention module, so that other modules of its layer (a recurrent mixer
    # beside it) are told apart from it.
    module_id: int


_ACTIVE_STEP: ContextVar[StepAttention | None] = ContextVar("splitserve_active_step", default=None)
_PROBE: ContextVar[dict[int, ProbedLayer] | None] = ContextVar("splitserve_probe", default=None)


def register_paged_attention() -> None:
    AttentionInterface.register(ATTENTION_NAME, paged_attention_forward)


@contextmanager
def active_step(step: StepAttention) -> Iterator[None]:
    """Makes `step` the metadata of every attention call made inside the block."""
    token = _ACTIVE_STEP.set(step)
    try:
        yield
    finally:
        _ACTIVE_STEP.reset(token)


@contextmanager
def probing(record: dict[int, ProbedLayer]) -> Iterator[None]:
    """Inside the block, attention runs without a cache over the tokens it is given and records
    what it sees of each layer in `record`, keyed by layer index."""
    token = _PROBE.set(record)
    try:
        yield
    finally:
        _PROBE.reset(token)


# flash-attn kernels exist only for half precision; float32 runs through SDPA.
FLASH_ATTN_DTYPES = (torch.float16, torch.bfloat16)


# sdpa: torch only (decodes gathered from their blocks into padded batches);
# cpu_paged: decodes and prefills through our C kernels reading K/V where they lie;
# flash_attn: CUDA varlen kernels.
BACKENDS = ("sdpa", "cpu_paged", "flash_attn")


class BackendUnavailable(ValueError):
    """The attention backend asked for cannot run here."""


def select_backend(device: torch.device, dtype: torch.dtype, requested: str = "auto") -> str:
    """auto: flash_attn on CUDA in half precision when installed, cpu_paged on CPU in float32
    when the kernel builds, else sdpa. `requested` overrides auto, and is refused where it
    cannot run."""
    flash_possible = (
        device.type == "cuda"
        and dtype in FLASH_ATTN_DTYPES
        and importlib.util.find_spec("flash_attn") is not None
    )
    if requested == "flash_attn" and not flash_possible:
        raise BackendUnavailable(
            "flash_attn needs CUDA, float16 or bfloat16, and the flash-attn package"
        )
    if requested in ("auto", "cpu_paged") and device.type == "cpu" and dtype == torch.float32:
        try:
            load_kernel_library()
            return "cpu_paged"
        except KernelUnavailable as error:
            if requested == "cpu_paged":
                raise BackendUnavailable(f"cpu_paged: {error}") from error
            logger.warning("event=cpu_kernels_unavailable fallback=sdpa reason=%r", str(error))
    elif requested == "cpu_paged":
        raise BackendUnavailable("cpu_paged needs the CPU and float32")
    if requested in BACKENDS:
        return requested
    return "flash_attn" if flash_possible else "sdpa"


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
    layer_idx = getattr(module, "layer_idx", None)
    if layer_idx is None:
        raise RuntimeError(f"{type(module).__name__} has no layer_idx to find its KV cache by")
    # GPT-OSS passes its per-head sink logits as s_aux.
    sinks: torch.Tensor | None = kwargs.get("s_aux")
    step: StepAttention | None = kwargs.get(STEP_KWARG) or _ACTIVE_STEP.get()
    if step is None:
        probe = _PROBE.get()
        if probe is None:
            raise RuntimeError(f"{ATTENTION_NAME} attention was called outside a step")
        geometry = LayerGeometry(key.shape[1], key.shape[3], value.shape[3])
        probe[layer_idx] = ProbedLayer(geometry, bool(getattr(module, "is_causal", True)), id(module))
        attended = explicit_attention(query[0], key[0], value[0], None, scaling, softcap, sinks)
        return attended.transpose(0, 1).contiguous().unsqueeze(0), None
    key_cache, value_cache = step.kv_cache.layer(layer_idx)
    # [1, heads, tokens, dim] -> [tokens, heads, dim]: the cache and kernels are token-major.
    q = query[0].transpose(0, 1)
    key_cache.index_copy_(0, step.slot_mapping, key[0].transpose(0, 1).to(key_cache.dtype))
    value_cache.index_copy_(0, step.slot_mapping, value[0].transpose(0, 1).to(value_cache.dtype))
    if step.backend == "flash_attn":
        if sinks is not None:
            raise NotImplementedError(
                "attention sinks are not supported by the flash_attn backend; "
                "start the executor with --attention-backend sdpa"
            )
        out = _flash_varlen(q, key_cache, value_cache, step, scaling, sliding_window, softcap)
    else:
        shaping = _Shaping(scaling, sliding_window, softcap, sinks)
        out = _sdpa(q, key_cache, value_cache, step, shaping)
    return out.unsqueeze(0), None


@dataclass(slots=True, frozen=True)
class _Shaping:
    """A layer's scale, window, soft-cap and sinks, as every sequence of the step uses them."""

    scale: float | None
    window: int | None
    softcap: float | None
    sinks: torch.Tensor | None

    def kernel_scale(self, key_dim: int) -> float:
        """The scale the C kernels apply: the layer's, else SDPA's default 1/sqrt(key_dim)."""
        return self.scale if self.scale is not None else key_dim**-0.5

    @property
    def explicit(self) -> bool:
        """SDPA has neither soft-capping nor sinks."""
        return self.softcap is not None or self.sinks is not None


def _sdpa(
    q: torch.Tensor,
    key_cache: torch.Tensor,
    value_cache: torch.Tensor,
    step: StepAttention,
    shaping: _Shaping,
) -> torch.Tensor:
    paged = step.paged_decode
    if paged is not None and paged.whole_step:
        return _kernel_decode(q, key_cache, value_cache, paged, step.kv_cache.block_size, shaping)
    out = q.new_empty(q.shape[0], q.shape[1], value_cache.shape[2])
    if step.paged_prefill is not None:
        load_prefill_kernel()(
            q,
            key_cache,
            value_cache,
            step.paged_prefill,
            shaping.kernel_scale(q.shape[-1]),
            shaping.window,
            shaping.softcap,
            shaping.sinks,
            out,
        )
    for seq in step.prefills:
        # [heads, new, dim] against [kv_heads, context, dim]
        queries = q[seq.token_start : seq.token_end].transpose(0, 1)
        keys = key_cache[seq.kv_slots].transpose(0, 1)
        values = value_cache[seq.kv_slots].transpose(0, 1)
        mask = seq.mask(shaping.window)
        if shaping.explicit:
            attended = explicit_attention(
                queries, keys, values, mask, shaping.scale, shaping.softcap, shaping.sinks
            )
        else:
            # Batched 4-D: for 3-D inputs torch's CPU dispatch falls back to the unfused math
            # kernel (a 400-token prefill: 96 ms there, 8 ms in the flash kernel).
            attended = F.scaled_dot_product_attention(
                queries.unsqueeze(0),
                keys.unsqueeze(0),
                values.unsqueeze(0),
                attn_mask=mask,
                is_causal=mask is None,
                scale=shaping.scale,
                enable_gqa=True,
            )[0]
        out[seq.token_start : seq.token_end] = attended.transpose(0, 1)
    for decodes in step.decodes:
        out[decodes.token_index] = _sdpa_decode(
            q, key_cache, value_cache, decodes, step.kv_cache, shaping
        )
    if step.paged_decode is not None:
        out[step.paged_decode.token_index] = _kernel_decode(
            q, key_cache, value_cache, step.paged_decode, step.kv_cache.block_size, shaping
        )
    return out


def _kernel_decode(
    q: torch.Tensor,
    key_cache: torch.Tensor,
    value_cache: torch.Tensor,
    decodes: PagedDecode,
    block_size: int,
    shaping: _Shaping,
) -> torch.Tensor:
    """[batch, heads, value_dim] attention of every decode token, read from the blocks."""
    queries = q.contiguous() if decodes.whole_step else q[decodes.token_index]
    return load_decode_kernel()(
        queries,
        key_cache,
        value_cache,
        decodes.block_table,
        decodes.context_lens,
        block_size,
        shaping.kernel_scale(q.shape[-1]),
        shaping.window,
        shaping.softcap,
        shaping.sinks,
    )


def _sdpa_decode(
    q: torch.Tensor,
    key_cache: torch.Tensor,
    value_cache: torch.Tensor,
    decodes: DecodeAttention,
    kv_cache: PagedKVCache,
    shaping: _Shaping,
) -> torch.Tensor:
    """[batch, heads, value_dim] attention of every decode token over its padded context."""
    batch, kv_heads = decodes.batch_size, key_cache.shape[1]
    key_dim, value_dim = key_cache.shape[2], value_cache.shape[2]
    key_shape = (batch, kv_heads, decodes.max_context, key_dim)
    value_shape = (batch, kv_heads, decodes.max_context, value_dim)
    if decodes.shared_scratch:
        keys, values = kv_cache.gather_buffers(key_shape, value_shape)
    else:
        keys, values = key_cache.new_empty(key_shape), value_cache.new_empty(value_shape)
    # Row-wise gathers straight into [batch, kv_heads, context, dim] (see DecodeAttention).
    index = decodes.gather_index
    torch.index_select(key_cache.view(-1, key_dim), 0, index, out=keys.view(-1, key_dim))
    torch.index_select(value_cache.view(-1, value_dim), 0, index, out=values.view(-1, value_dim))
    mask = decodes.mask(shaping.window)
    if shaping.explicit:
        # [batch, heads, 1, dim]; the mask gains the query-group axis explicit_attention adds.
        attended = explicit_attention(
            q[decodes.token_index].unsqueeze(2),
            keys,
            values,
            mask.unsqueeze(2),
            shaping.scale,
            shaping.softcap,
            shaping.sinks,
        )
        return attended.reshape(batch, -1, value_dim)
    # Grouped-query attention without repeating K/V: the query heads sharing a KV head (heads
    # are grouped consecutively, as in transformers' repeat_kv) become that head's query rows.
    queries = q[decodes.token_index].reshape(batch, kv_heads, -1, key_dim)
    attended = F.scaled_dot_product_attention(
        queries, keys, values, attn_mask=mask, scale=shaping.scale
    )
    # reshape: CUDA's memory-efficient kernel (the one a boolean mask gets in float32) returns
    # its output transposed, not contiguous.
    return attended.reshape(batch, -1, value_dim)


def _flash_varlen(
    q: torch.Tensor,
    key_cache: torch.Tensor,
    value_cache: torch.Tensor,
    step: StepAttention,
    scaling: float | None,
    window: int | None,
    softcap: float | None,
) -> torch.Tensor:
    from flash_attn import flash_attn_varlen_func

    varlen = step.varlen
    if varlen is None:
        raise RuntimeError("flash_attn backend without varlen metadata")
    values = value_cache[varlen.kv_slots]
    value_dim = values.shape[-1]
    if value_dim < q.shape[-1]:
        # flash-attn wants one head width; narrower values (latent attention) are zero-padded
        # and the padding dropped from the output, as transformers does.
        values = F.pad(values, (0, q.shape[-1] - value_dim))
    # Causal masking in flash-attn aligns the query block to the end of the keys, which is
    # exactly "new tokens follow the cached ones".
    out = flash_attn_varlen_func(
        q,
        key_cache[varlen.kv_slots],
        values,
        cu_seqlens_q=varlen.cu_seqlens_q,
        cu_seqlens_k=varlen.cu_seqlens_k,
        max_seqlen_q=varlen.max_seqlen_q,
        max_seqlen_k=varlen.max_seqlen_k,
        softmax_scale=scaling,
        causal=True,
        window_size=(window - 1, 0) if window is not None else (-1, -1),
        softcap=softcap if softcap is not None else 0.0,
    )
    return out[..., :value_dim]
