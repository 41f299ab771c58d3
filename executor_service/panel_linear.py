"""float32 linear layers through the C panel kernel (kernels/panel_linear.c), the weights packed
once into panels of 16 output columns.

Against oneDNN's packed sgemm, two cores of an AMD EPYC (AVX-512), the layers' weights read from
memory as in a step (more layers than the caches hold), best of 6 alternated passes:

| rows | SmolLM2's 30 layers | random Llama's 8 layers |
|---:|---|---|
| 8 | 20.9 -> 14.5 ms (81 -> 117 GFLOP/s) | |
| 32 | 42.8 -> 36.8 ms (159 -> 185 GFLOP/s) | 9.2 -> 8.3 ms (165 -> 183 GFLOP/s) |
| 2,048 (8 layers) | 206 -> 203 GFLOP/s | 212 -> 207 GFLOP/s |

It needs AVX-512F; elsewhere PackedLinear keeps oneDNN.
"""

from __future__ import annotations

import ctypes
import functools

import torch

from executor_service.cpu_kernels import (
    KernelUnavailable,
    declare,
    float32_cpu,
    load_kernel_library,
)

# How errors name this wrapper.
KERNEL = "the panel kernel"


class PanelKernel:
    """panel_pack and panel_linear, with their argument types declared once."""

    def __init__(self, library: ctypes.CDLL) -> None:
        pointer, size = ctypes.c_void_p, ctypes.c_int64
        if not declare(library.panel_linear_available, [], size)():
            raise KernelUnavailable("the panel linear kernel needs AVX-512F, which this CPU lacks")
        self._packed_floats = declare(library.panel_packed_floats, [size, size], size)
        self._pack = declare(library.panel_pack, [pointer, size, size, pointer], None)
        self._linear = declare(
            library.panel_linear, [pointer, size, size, pointer, size, pointer, pointer, ctypes.c_int], None
        )

    def pack(self, weight: torch.Tensor) -> torch.Tensor:
        """[out, in] float32 weight -> its panels (a flat tensor); the weight is not kept."""
        weight = float32_cpu(weight.detach(), KERNEL).contiguous()
        out_features, in_features = weight.shape
        packed = torch.empty(self._packed_floats(out_features, in_features), dtype=torch.float32)
        self._pack(weight.data_ptr(), out_features, in_features, packed.data_ptr())
        return packed

    def linear(
        self, x: torch.Tensor, packed: torch.Tensor, out_features: int, bias: torch.Tensor | None
    ) -> torch.Tensor:
        """x [..., in] float32 -> x W^T + b [..., out], packed from pack(W)."""
        in_features = x.shape[-1]
        if packed.numel() != self._packed_floats(out_features, in_features):
            raise ValueError(f"x's rows of {in_features} do not fit the packed weight ({packed.numel()} floats)")
        rows = float32_cpu(x, KERNEL).reshape(-1, in_features).contiguous()
        out = torch.empty(rows.shape[0], out_features, dtype=torch.float32)
        if bias is not None:
            bias = float32_cpu(bias.detach(), KERNEL).contiguous()
            if bias.shape != (out_features,):
                raise ValueError(f"bias {tuple(bias.shape)} does not fit {out_features} outputs")
        if rows.shape[0]:
            self._linear(
                rows.data_ptr(), rows.shape[0], in_features, packed.data_ptr(), out_features,
                None if bias is None else bias.data_ptr(), out.data_ptr(), torch.get_num_threads(),
            )
        return out.view(*x.shape[:-1], out_features)


@functools.cache
def load_panel_kernel() -> PanelKernel:
    """The kernel; raises KernelUnavailable saying why it cannot be had here."""
    return PanelKernel(load_kernel_library())
