"""Greedy sampling's argmax in C (kernels/row_argmax.c): the same indices as torch.argmax over
the last dimension, NaNs and ties included.

torch's CPU argmax is a scalar loop; this one is vectorised (docs/cpu-executor.md, "Measured",
has the figures).
"""

from __future__ import annotations

import ctypes
import functools

import torch

from executor_service.kernels.cpu_kernels import declare, load_kernel_library


class RowArgmax:
    """row_argmax, with its argument types declared once."""

    def __init__(self, library: ctypes.CDLL) -> None:
        pointer, size = ctypes.c_void_p, ctypes.c_int64
        self._function = declare(library.row_argmax, [pointer, size, size, size, pointer, ctypes.c_int], None)

    def __call__(self, logits: torch.Tensor) -> torch.Tensor:
        """[rows, vocab] float32 CPU logits -> [rows] int64: each row's first largest index."""
        if logits.dtype != torch.float32 or logits.device.type != "cpu" or logits.dim() != 2:
            raise ValueError(
                "row argmax takes [rows, vocab] float32 CPU logits, "
                f"not {logits.dtype} {tuple(logits.shape)} on {logits.device}"
            )
        if logits.shape[1] == 0:
            raise ValueError("argmax over an empty vocabulary")
        if logits.stride(1) != 1:
            logits = logits.contiguous()
        out = torch.empty(logits.shape[0], dtype=torch.int64)
        self._function(
            logits.data_ptr(), logits.shape[0], logits.shape[1], logits.stride(0), out.data_ptr(), torch.get_num_threads()
        )
        return out


@functools.cache
def load_row_argmax() -> RowArgmax:
    """The kernel; raises cpu_kernels.KernelUnavailable saying why it cannot be had."""
    return RowArgmax(load_kernel_library())
