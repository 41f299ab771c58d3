"""float32 linear layers through the C panel kernel (kernels/panel_linear.c), the weights packed
once into panels of 16 output columns.

Two epilogues save a pass over the output, each giving the bits of the separate operations:
linear(..., residual) adds into the residual stream in place (the lean forward's o_proj and
down_proj), and linear_silu_mul gives SiLU(gate) * up of a joined gate-and-up weight without
writing the [rows, 2 x width] product.

With up to 8 row tiles (64 rows), each tile prefetches a share of the next panel group's weights,
since a decode step streams every weight from memory; prefill's row blocks reuse each group from
L2 and do not prefetch. K is taken in blocks of ~128 so that a block of a panel group's weights
stays in L1 across the row tiles that use it (kernels/panel_linear.c says how the bits stay those
of one chain).

A weight whose every 32 consecutive inputs of an output take values d q + m (q in 0..15, d and m
per block: dequantized from GGUF's Q4_1, as the default SmolLM2 copy is) is also kept as those
4-bit blocks, ~0.75 bytes a weight, verified value by value when packed (pack_blocks). Calls of up
to 64 rows read them and rebuild the floats in L1: the same bits from under a fifth of the memory
traffic. On CPUs with AMX (use_amx, on by default) every call multiplies on its bf16 tiles instead
(kernels/panel_amx.c), x split exactly into three bf16 pieces. With blocks, the levels are exact
in bf16, so every product is exact and only float32 additions round; float32 weights (K a whole
number of 32s) are split into three pieces too, and the six largest of the nine products kept.
Not the float path's bits, but at least as close to the exact product; a row's bits still do not
depend on the rows beside it or the thread count.

It needs AVX-512F; elsewhere PackedLinear keeps oneDNN. docs/cpu-executor.md ("Measured") has
what each of these choices measured against oneDNN.
"""

from __future__ import annotations

import copy
import ctypes
import functools

import torch

from executor_service.kernels.cpu_kernels import (
    KernelUnavailable,
    declare,
    float32_cpu,
    load_kernel_library,
    pointer_or_none,
)

# How errors name this wrapper.
KERNEL = "the panel kernel"


class PanelKernel:
    """panel_pack, panel_linear and panel_linear_silu_mul, with their argument types declared
    once."""

    def __init__(self, library: ctypes.CDLL) -> None:
        pointer, size, threads = ctypes.c_void_p, ctypes.c_int64, ctypes.c_int
        if not declare(library.panel_linear_available, [], size)():
            raise KernelUnavailable("the panel linear kernel needs AVX-512F, which this CPU lacks")
        packed_floats = declare(library.panel_packed_floats, [size, size], size)
        # Output columns per panel: a weight of n outputs packs into ceil(n / panel) panels.
        self.panel = int(packed_floats(1, 1))
        self._pack = declare(library.panel_pack, [pointer, size, size, pointer], None)
        self._block_bytes = declare(library.panel_q4_bytes, [size, size], size)
        self._pack_blocks = declare(library.panel_q4_pack, [pointer, size, size, pointer], size)
        self._linear = declare(
            library.panel_linear,
            [pointer, size, size, pointer, pointer, size, pointer, pointer, pointer, threads],
            None,
        )
        self._linear_silu_mul = declare(
            library.panel_linear_silu_mul,
            [pointer, size, size, pointer, pointer, size, pointer, pointer, threads],
            None,
        )
        self._amx_use = declare(library.panel_amx_use, [size], size)
        # Whether calls multiply on AMX's tiles (kernels/panel_amx.c).
        self.amx = bool(self._amx_use(1))
        # Whether pack_blocks keeps weights made of 4-bit blocks as such (without_blocks).
        self.reads_blocks = True

    def without_blocks(self) -> PanelKernel:
        """This kernel with pack_blocks keeping no weight as 4-bit blocks: every weight is read
        as float32 panels, as an ordinary checkpoint's would be (the executor's
        --no-weight-blocks). The bits are the same either way; only the memory traffic differs."""
        plain = copy.copy(self)
        plain.reads_blocks = False
        return plain

    def use_amx(self, want: bool) -> bool:
        """Turns the AMX path on (where the CPU, the compiler and the OS allow it) or off, for
        every caller in the process: the kernel library is loaded once. Returns whether it is on."""
        self.amx = bool(self._amx_use(int(want)))
        return self.amx

    def packed_floats(self, out_features: int, in_features: int) -> int:
        return -(-out_features // self.panel) * self.panel * in_features

    def pack(self, weight: torch.Tensor) -> torch.Tensor:
        """[out, in] float32 weight -> its panels (a flat tensor); the weight is not kept."""
        weight = float32_cpu(weight.detach(), KERNEL).contiguous()
        out_features, in_features = weight.shape
        packed = torch.empty(self.packed_floats(out_features, in_features), dtype=torch.float32)
        self._pack(weight.data_ptr(), out_features, in_features, packed.data_ptr())
        return packed

    def pack_blocks(self, weight: torch.Tensor) -> torch.Tensor | None:
        """[out, in] float32 weight -> its 4-bit blocks (a flat uint8 tensor), or None where some
        value is not d q + m of its block (or in is not a whole number of blocks), or where this
        kernel reads no blocks (without_blocks)."""
        if not self.reads_blocks:
            return None
        weight = float32_cpu(weight.detach(), KERNEL).contiguous()
        out_features, in_features = weight.shape
        blocks = torch.empty(self._block_bytes(out_features, in_features), dtype=torch.uint8)
        if not self._pack_blocks(weight.data_ptr(), out_features, in_features, blocks.data_ptr()):
            return None
        return blocks

    def linear(
        self,
        x: torch.Tensor,
        packed: torch.Tensor,
        out_features: int,
        bias: torch.Tensor | None,
        residual: torch.Tensor | None = None,
        blocks: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """x [..., in] float32 -> x W^T + b [..., out], packed from pack(W) (and blocks from
        pack_blocks(W), or None). With a residual (float32, contiguous, x's shape but out wide)
        the sum (x W^T + b) + residual is written into it, in place, and it is returned."""
        rows, bias = self._operands(x, packed, out_features, bias, blocks)
        if residual is None:
            out = torch.empty(rows.shape[0], out_features, dtype=torch.float32)
        else:
            out = float32_cpu(residual, KERNEL)
            if out.shape != (*x.shape[:-1], out_features) or not out.is_contiguous():
                raise ValueError(f"residual {tuple(out.shape)} is not a contiguous {(*x.shape[:-1], out_features)}")
        if rows.shape[0]:
            self._linear(
                rows.data_ptr(), rows.shape[0], rows.shape[1], packed.data_ptr(), pointer_or_none(blocks),
                out_features, pointer_or_none(bias), None if residual is None else out.data_ptr(),
                out.data_ptr(), torch.get_num_threads(),
            )
        return out.view(*x.shape[:-1], out_features)

    def linear_silu_mul(
        self,
        x: torch.Tensor,
        packed: torch.Tensor,
        width: int,
        bias: torch.Tensor | None,
        blocks: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """x [..., in] -> silu(gate) * up [..., width], where gate and up are x's products with
        the two halves of a joined [gate; up] weight of 2 * width outputs packed by pack(); width
        must be a multiple of self.panel. The bits of linear() followed by LayerKernels.silu_mul."""
        if width % self.panel:
            raise ValueError(f"gate and up of width {width} are not whole panels of {self.panel}")
        rows, bias = self._operands(x, packed, 2 * width, bias, blocks)
        out = torch.empty(rows.shape[0], width, dtype=torch.float32)
        if rows.shape[0]:
            self._linear_silu_mul(
                rows.data_ptr(), rows.shape[0], rows.shape[1], packed.data_ptr(), pointer_or_none(blocks), width,
                pointer_or_none(bias), out.data_ptr(), torch.get_num_threads(),
            )
        return out.view(*x.shape[:-1], width)

    def _operands(
        self,
        x: torch.Tensor,
        packed: torch.Tensor,
        out_features: int,
        bias: torch.Tensor | None,
        blocks: torch.Tensor | None,
    ) -> tuple[torch.Tensor, torch.Tensor | None]:
        """x's rows as a contiguous [rows, in] float32 matrix, and the bias and blocks checked."""
        in_features = x.shape[-1]
        if packed.numel() != self.packed_floats(out_features, in_features):
            raise ValueError(f"x's rows of {in_features} do not fit the packed weight ({packed.numel()} floats)")
        if blocks is not None and (
            blocks.dtype != torch.uint8 or blocks.numel() != self._block_bytes(out_features, in_features)
        ):
            raise ValueError(f"the 4-bit blocks do not fit a weight of {out_features} x {in_features}")
        rows = float32_cpu(x, KERNEL).reshape(-1, in_features).contiguous()
        if bias is not None:
            bias = float32_cpu(bias.detach(), KERNEL).contiguous()
            if bias.shape != (out_features,):
                raise ValueError(f"bias {tuple(bias.shape)} does not fit {out_features} outputs")
        return rows, bias


@functools.cache
def load_panel_kernel() -> PanelKernel:
    """The kernel; raises KernelUnavailable saying why it cannot be had here."""
    return PanelKernel(load_kernel_library())
