"""The C prefill attention kernel (kernels/paged_prefill.c), called on the tensors' memory.

Why C: torch's fused SDPA on the CPU runs a SmolLM2 prefill's attention (7 sequences of 98-500
tokens, 9/3 heads of 64) at ~57 GFLOP/s on two AMD EPYC cores, where the kernel's
register-blocked products reach ~120-130, and it needs each sequence's K/V gathered from the
blocks into a copy first. The kernel reads K/V where they lie and attends every prefill of the
step in one call.
"""

from __future__ import annotations

import ctypes
import functools

import torch

from executor_service.attention.attention_metadata import PagedPrefill
from executor_service.kernels.cpu_kernels import attention_function, load_kernel_library


class PrefillKernel:
    """paged_prefill_attention, with its argument types declared once."""

    def __init__(self, library: ctypes.CDLL) -> None:
        self._function = attention_function(library, "paged_prefill_attention", 10, 6)

    def __call__(
        self,
        queries: torch.Tensor,
        key_cache: torch.Tensor,
        value_cache: torch.Tensor,
        prefill: PagedPrefill,
        scale: float,
        window: int | None,
        softcap: float | None,
        sinks: torch.Tensor | None,
        out: torch.Tensor,
    ) -> None:
        """Writes the attention of every prefill sequence's queries into its rows of `out`.

        queries [tokens, heads, key_dim] (token rows may be strided, heads not), out [tokens,
        heads, value_dim] contiguous. The C code trusts shapes and memory layout, so they are
        checked here; that every slot lies in the cache is checked where the slots are made
        (attention_metadata._paged_prefill).
        """
        tokens, heads, key_dim = queries.shape
        kv_heads, value_dim = key_cache.shape[1], value_cache.shape[2]
        if queries.stride(2) != 1 or queries.stride(1) != key_dim:
            queries = queries.contiguous()
        if any(t.dtype != torch.float32 for t in (queries, key_cache, value_cache, out)):
            raise ValueError("the prefill kernel takes float32 queries, cache and output")
        if not (key_cache.is_contiguous() and value_cache.is_contiguous() and out.is_contiguous()):
            raise ValueError("the prefill kernel takes a contiguous cache and output")
        if key_cache.shape[2] != key_dim or heads % kv_heads:
            raise ValueError(
                f"queries {tuple(queries.shape)} do not fit a cache of {kv_heads} KV heads of "
                f"width {key_cache.shape[2]} and values of width {value_dim}"
            )
        if out.shape != (tokens, heads, value_dim):
            raise ValueError(f"output {tuple(out.shape)} is not {(tokens, heads, value_dim)}")
        if sinks is not None:
            sinks = sinks.to(torch.float32).contiguous()
        failed = self._function(
            queries.data_ptr(),
            key_cache.data_ptr(),
            value_cache.data_ptr(),
            prefill.token_start.data_ptr(),
            prefill.num_new.data_ptr(),
            prefill.num_cached.data_ptr(),
            prefill.slot_start.data_ptr(),
            prefill.slots.data_ptr(),
            sinks.data_ptr() if sinks is not None else None,
            out.data_ptr(),
            prefill.token_start.shape[0],
            queries.stride(0),
            heads,
            kv_heads,
            key_dim,
            value_dim,
            scale,
            window or 0,
            softcap or 0.0,
            torch.get_num_threads(),
        )
        if failed:
            raise MemoryError("the prefill kernel could not allocate its scratch memory")


@functools.cache
def load_prefill_kernel() -> PrefillKernel:
    """The kernel; raises cpu_kernels.KernelUnavailable saying why it cannot be had."""
    return PrefillKernel(load_kernel_library())
