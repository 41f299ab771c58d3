"""A pure decode step's decoder layers as one C call (kernels/decode_layers.c), for LeanLlama.

On CPU a decode step of a small model spends a share of its time in the interpreter between
kernels: per layer two RMSNorms, four GEMMs, RoPE, two K/V writes and attention, each reached
through a module's forward, its argument checks, views and a fresh output tensor. Here the
layer stack is one call that runs the same kernels on the same operands in the same order, so
the hidden states are the Python loop's bit for bit (tests/executor/test_decode_program.py);
the operands every step shares (weights, norms, shapes) are laid out once, at start
(docs/cpu-executor.md, "Measured", has what it saves).

It applies where every layer is a fused Llama layer on the C kernels (panel GEMMs with the MLP
gated in the GEMM, C RMSNorm and RoPE), attention is ours on the cpu_paged backend, and the step
is decodes only in token order (the decode kernel's whole step); any other step keeps the loop.
"""

from __future__ import annotations

import ctypes
from typing import TYPE_CHECKING

import torch

from executor_service.attention.attention_metadata import StepAttention
from executor_service.kernels.cpu_kernels import (
    KernelUnavailable,
    declare,
    load_kernel_library,
    pointer_or_none,
)

if TYPE_CHECKING:
    from executor_service.attention.kv_cache import PagedKVCache
    from executor_service.cpu_forward.fused_layers import (
        FusedAttention,
        FusedMLP,
        FusedRMSNorm,
    )
    from executor_service.cpu_forward.packed_linear import PackedLinear


class _LayerWeights(ctypes.Structure):
    _fields_ = [
        (name, ctypes.c_void_p)
        for name in (
            "input_norm", "post_norm", "qkv", "qkv_bias", "o", "o_bias",
            "gate_up", "gate_up_bias", "down", "down_bias",
            "qkv_blocks", "o_blocks", "gate_up_blocks", "down_blocks",
        )
    ]


class _Step(ctypes.Structure):
    _fields_ = [
        *((name, ctypes.c_int64) for name in ("rows", "hidden", "heads", "kv_heads", "head_dim", "intermediate")),
        ("eps", ctypes.c_float),
        ("scale", ctypes.c_float),
        *((name, ctypes.c_void_p) for name in ("cos", "sin", "slots", "block_table", "context_lens")),
        ("block_size", ctypes.c_int64),
        ("table_width", ctypes.c_int64),
        ("threads", ctypes.c_int),
    ]


def _gemm(linear: PackedLinear) -> tuple[int, int | None, int | None]:
    bias = None if linear.bias is None else linear.bias.detach()
    return linear.packed.data_ptr(), pointer_or_none(bias), pointer_or_none(linear.blocks)


Layer = tuple["FusedRMSNorm", "FusedAttention", "FusedRMSNorm", "FusedMLP"]


class DecodeProgram:
    """The layer stack of a LeanLlama's pure decode steps; build with decode_program()."""

    def __init__(self, library: ctypes.CDLL, layers: list[Layer]) -> None:
        pointer, size = ctypes.c_void_p, ctypes.c_int64
        self._run = declare(library.decode_layers, [pointer, size, pointer, pointer, pointer, pointer], ctypes.c_int)
        _, attention, post_norm, mlp = layers[0]
        self._shape = dict(
            hidden=attention.o_proj.out_features,
            heads=attention.num_heads,
            kv_heads=attention.num_kv_heads,
            head_dim=attention.head_dim,
            intermediate=mlp.intermediate,
            eps=post_norm.eps,
            scale=attention.scaling,
        )
        self._weights = (_LayerWeights * len(layers))()
        for entry, (input_norm, attention, post_norm, mlp) in zip(self._weights, layers, strict=True):
            entry.input_norm, entry.post_norm = input_norm.weight.data_ptr(), post_norm.weight.data_ptr()
            entry.qkv, entry.qkv_bias, entry.qkv_blocks = _gemm(attention.qkv)
            entry.o, entry.o_bias, entry.o_blocks = _gemm(attention.o_proj)
            entry.gate_up, entry.gate_up_bias, entry.gate_up_blocks = _gemm(mlp.gate_up)
            entry.down, entry.down_bias, entry.down_blocks = _gemm(mlp.down_proj)
        # The cache the pointer tables below were laid out for, held so that its memory stays.
        self._caches: tuple[PagedKVCache, ctypes.Array, ctypes.Array] | None = None

    def covers(self, step: StepAttention) -> bool:
        """Whether this step is one the program runs: decodes only, in token order, on the decode
        kernel. Only the cpu_paged backend plans a paged_decode, and only for steps through our
        attention (the self-check's references run the model's own forward, never this one), so
        the step itself says so: no private transformers attribute is read, which a rename
        upstream would turn into a silent fallback (tests/executor/test_decode_program.py counts
        the steps the program took)."""
        paged = step.paged_decode
        return paged is not None and paged.whole_step and step.kv_cache.shape.dtype == torch.float32

    def run(
        self, hidden: torch.Tensor, position_embeddings: tuple[torch.Tensor, torch.Tensor], step: StepAttention
    ) -> None:
        """hidden [1, rows, hidden] (contiguous float32) through every layer, in place; the
        step's K/V land in its cache as the loop would write them."""
        paged = step.paged_decode
        if paged is None or hidden.dtype != torch.float32 or not hidden.is_contiguous():
            raise ValueError("the decode program takes a covered step's contiguous float32 hidden states")
        rows = hidden.shape[1]
        cos, sin = (e.reshape(rows, -1).contiguous() for e in position_embeddings)
        slots = step.slot_mapping.contiguous()
        block_table, context_lens = paged.block_table.contiguous(), paged.context_lens.contiguous()
        operands = _Step(
            rows=rows,
            **self._shape,
            cos=cos.data_ptr(),
            sin=sin.data_ptr(),
            slots=slots.data_ptr(),
            block_table=block_table.data_ptr(),
            context_lens=context_lens.data_ptr(),
            block_size=step.kv_cache.block_size,
            table_width=block_table.shape[1],
            threads=torch.get_num_threads(),
        )
        keys, values = self._cache_tables(step)
        weights = ctypes.addressof(self._weights)
        if self._run(weights, len(self._weights), keys, values, ctypes.byref(operands), hidden.data_ptr()):
            raise MemoryError("the decode program could not allocate its scratch memory")

    def _cache_tables(self, step: StepAttention) -> tuple[ctypes.Array, ctypes.Array]:
        """Every layer's K and V cache pointers, laid out once per cache."""
        cache = step.kv_cache
        if self._caches is None or self._caches[0] is not cache:
            count = len(self._weights)
            layers = [cache.layer(i) for i in range(count)]
            keys = (ctypes.c_void_p * count)(*(k.data_ptr() for k, _ in layers))
            values = (ctypes.c_void_p * count)(*(v.data_ptr() for _, v in layers))
            self._caches = (cache, keys, values)
        return self._caches[1], self._caches[2]


def decode_program(layers: list[Layer]) -> DecodeProgram | None:
    """A program for a LeanLlama's layers, or None where some layer is not on the C kernels
    (oneDNN GEMMs, torch elementwise passes, an MLP not gated in its GEMM) or the library
    lacks the program (no AVX-512: no panel kernel)."""
    shapes: set[tuple[float, ...]] = set()
    for input_norm, attention, post_norm, mlp in layers:
        shapes.add((
            attention.o_proj.out_features, attention.num_heads, attention.num_kv_heads, attention.head_dim,
            attention.scaling, mlp.intermediate, input_norm.eps,
        ))
        gemms = (attention.qkv, attention.o_proj, mlp.gate_up, mlp.down_proj)
        if any(linear.panels is None for linear in gemms) or not mlp.gated:
            return None
        if attention.kernels is None or input_norm.kernels is None or post_norm.kernels is None:
            return None
        if attention.o_proj.in_features != attention.num_heads * attention.head_dim:
            return None
        if input_norm.eps != post_norm.eps:
            return None
    # One set of shapes (and one eps) serves every layer.
    if len(shapes) != 1:
        return None
    try:
        library = load_kernel_library()
    except KernelUnavailable:
        return None
    if not hasattr(library, "decode_layers"):
        return None
    return DecodeProgram(library, layers)
