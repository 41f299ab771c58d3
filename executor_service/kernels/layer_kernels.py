"""The C elementwise passes of the fused Llama layers (kernels/layer_elementwise.c): RMSNorm,
RoPE in place, and SiLU-times-up, each one pass instead of torch's two to six operations; and
the activations of layers that are not fused (kernels/activations.c, kernel_activations.py).
What they save: docs/cpu-executor.md, "Measured".
"""

from __future__ import annotations

import ctypes
import functools

import torch

from executor_service.kernels.cpu_kernels import (
    declare,
    float32_cpu,
    load_kernel_library,
)

# How errors name this wrapper.
KERNEL = "the layer kernels"


class LayerKernels:
    """The three passes, with their argument types declared once. Each takes float32 tensors
    and checks the layout the C code assumes."""

    def __init__(self, library: ctypes.CDLL) -> None:
        pointer, size, real, threads = ctypes.c_void_p, ctypes.c_int64, ctypes.c_float, ctypes.c_int
        self._rms_norm = declare(library.rms_norm, [pointer] * 3 + [size] * 2 + [real, threads], None)
        self._silu_mul = declare(library.silu_mul, [pointer] * 2 + [size] * 2 + [threads], None)
        self._rope = declare(library.rope, [pointer] * 3 + [size] * 4 + [threads], None)
        self._activation = declare(library.activation, [ctypes.c_int] + [pointer] * 2 + [size, threads], ctypes.c_int)

    def rms_norm(self, x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
        """weight * x / sqrt(mean(x^2) + eps) over the last dimension."""
        x = float32_cpu(x, KERNEL).contiguous()
        weight = float32_cpu(weight, KERNEL).contiguous()
        dim = x.shape[-1]
        if weight.shape != (dim,):
            raise ValueError(f"RMSNorm weight {tuple(weight.shape)} does not fit rows of {dim}")
        out = torch.empty_like(x)
        self._rms_norm(x.data_ptr(), weight.data_ptr(), out.data_ptr(), x.numel() // dim, dim, eps, torch.get_num_threads())
        return out

    def silu_mul(self, gate_up: torch.Tensor) -> torch.Tensor:
        """silu(gate) * up, for [..., 2 * width] holding gate then up side by side."""
        gate_up = float32_cpu(gate_up, KERNEL).contiguous()
        width = gate_up.shape[-1] // 2
        if gate_up.shape[-1] != 2 * width:
            raise ValueError(f"gate and up side by side need an even width, not {gate_up.shape[-1]}")
        out = gate_up.new_empty(*gate_up.shape[:-1], width)
        self._silu_mul(gate_up.data_ptr(), out.data_ptr(), out.numel() // max(width, 1), width, torch.get_num_threads())
        return out

    def rope_(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> None:
        """x [rows, heads, dim] (heads contiguous, rows may be strided) rotated in place by
        cos and sin [rows, dim]."""
        rows, heads, dim = x.shape
        float32_cpu(x, KERNEL)
        if x.stride(2) != 1 or x.stride(1) != dim or dim % 2:
            raise ValueError(f"RoPE in place needs contiguous heads of even width, not strides {x.stride()}")
        cos, sin = float32_cpu(cos, KERNEL).contiguous(), float32_cpu(sin, KERNEL).contiguous()
        if cos.shape != (rows, dim) or sin.shape != (rows, dim):
            raise ValueError(f"cos {tuple(cos.shape)} and sin {tuple(sin.shape)} are not {(rows, dim)}")
        self._rope(x.data_ptr(), cos.data_ptr(), sin.data_ptr(), rows, heads, dim, x.stride(0), torch.get_num_threads())

    def activation(self, kind: int, x: torch.Tensor) -> torch.Tensor:
        """The activation numbered `kind` in kernels/activations.c, element by element."""
        x = float32_cpu(x, KERNEL).contiguous()
        out = torch.empty_like(x)
        if self._activation(kind, x.data_ptr(), out.data_ptr(), x.numel(), torch.get_num_threads()):
            raise ValueError(f"the kernels know no activation {kind}")
        return out


@functools.cache
def load_layer_kernels() -> LayerKernels:
    """The kernels; raises cpu_kernels.KernelUnavailable saying why they cannot be had."""
    return LayerKernels(load_kernel_library())
