"""The C decode attention kernel (kernels/paged_decode.c), called on the tensors' memory.

Why C: a decode step attends each sequence over its whole context, and in torch that means
gathering every context from its blocks into a padded copy per layer, hundreds of megabytes
written and read again per step (docs/cpu-executor.md, "Measured"). The kernel reads each K and
V row once, where it lies.
"""

from __future__ import annotations

import ctypes
import functools

import torch

from executor_service.kernels.cpu_kernels import attention_function, load_kernel_library


class DecodeKernel:
    """paged_decode_attention, with its argument types declared once."""

    def __init__(self, library: ctypes.CDLL) -> None:
        self._function = attention_function(library, "paged_decode_attention", 7, 7)

    def __call__(
        self,
        queries: torch.Tensor,
        key_cache: torch.Tensor,
        value_cache: torch.Tensor,
        block_table: torch.Tensor,
        context_lens: torch.Tensor,
        block_size: int,
        scale: float,
        window: int | None,
        softcap: float | None,
        sinks: torch.Tensor | None,
    ) -> torch.Tensor:
        """queries [batch, heads, key_dim] over the cache -> [batch, heads, value_dim].

        The C code trusts shapes and memory layout, so they are checked here; that every block
        id lies in the cache and every context fits its table is checked once per step, where
        the table is built (attention_metadata._paged_decode).
        """
        batch, heads, key_dim = queries.shape
        kv_heads, value_dim = key_cache.shape[1], value_cache.shape[2]
        tensors = (queries, key_cache, value_cache)
        if any(t.dtype != torch.float32 or not t.is_contiguous() for t in tensors):
            raise ValueError("the decode kernel takes contiguous float32 queries and cache")
        if key_cache.shape[2] != key_dim or heads % kv_heads:
            raise ValueError(
                f"queries {tuple(queries.shape)} do not fit a cache of {kv_heads} KV heads "
                f"of width {key_cache.shape[2]}"
            )
        if block_table.dtype != torch.int64 or context_lens.dtype != torch.int64:
            raise ValueError("block table and context lengths must be int64")
        if block_table.shape[0] != batch or context_lens.shape != (batch,):
            raise ValueError("block table and context lengths need one row per query")
        block_table = block_table.contiguous()
        context_lens = context_lens.contiguous()
        if sinks is not None:
            sinks = sinks.to(torch.float32).contiguous()
        out = queries.new_empty(batch, heads, value_dim)
        failed = self._function(
            queries.data_ptr(),
            key_cache.data_ptr(),
            value_cache.data_ptr(),
            block_table.data_ptr(),
            context_lens.data_ptr(),
            sinks.data_ptr() if sinks is not None else None,
            out.data_ptr(),
            batch,
            heads,
            kv_heads,
            key_dim,
            value_dim,
            block_size,
            block_table.shape[1],
            scale,
            window or 0,
            softcap or 0.0,
            torch.get_num_threads(),
        )
        if failed:
            raise MemoryError("the decode kernel could not allocate its scratch memory")
        return out


@functools.cache
def load_decode_kernel() -> DecodeKernel:
    """The kernel; raises cpu_kernels.KernelUnavailable saying why it cannot be had."""
    return DecodeKernel(load_kernel_library())
