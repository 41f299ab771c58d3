"""The C kernels' own floating-point functions, built with the kernels' flags: the exponential
(vector_exp.h) is within 1.01 ulp of the true value over its whole range and gives the same bits
in a vectorised loop as called alone; SiLU-times-up (silu_mul.h) agrees with torch at the
extremes, where an approximate exponential used to turn overflow into NaN; and the flags hold
nothing that lets the compiler change a result (the kernels' bits must not belong to a compiler
version)."""

from __future__ import annotations

import ctypes
import tempfile
from collections.abc import Iterator
from pathlib import Path

import numpy as np
import pytest
import torch

from executor_service.kernels.cpu_kernels import (
    COMPILE_FLAGS,
    KERNEL_DIR,
    KernelUnavailable,
    compile_library,
)

# Vectorised like the kernels' loops (omp simd), and one element per call for the scalar side.
SHIM = """
#include <stdint.h>
#include "{kernels}/silu_mul.h"
#include "{kernels}/softmax_exp.h"
void exp_array(const float *x, float *y, int64_t n) {{
#pragma omp simd
    for (int64_t i = 0; i < n; i++) y[i] = exp_in_range(x[i]);
}}
void softmax_exp_array(const float *x, float *y, int64_t n) {{
#pragma omp simd
    for (int64_t i = 0; i < n; i++) y[i] = softmax_exp(x[i]);
}}
float __attribute__((noinline)) exp_one(float x) {{ return exp_in_range(x); }}
void silu_mul_array(const float *gate, const float *up, float *out, int64_t n) {{ silu_mul_row(gate, up, out, n); }}
"""


@pytest.fixture(scope="module")
def math_library() -> Iterator[ctypes.CDLL]:
    with tempfile.TemporaryDirectory(prefix="kernel-math-") as tmp:
        source = Path(tmp) / "kernel_math.c"
        source.write_text(SHIM.format(kernels=KERNEL_DIR))
        try:
            library = ctypes.CDLL(str(compile_library([source], Path(tmp))))
        except KernelUnavailable as unavailable:
            pytest.skip(f"no C compiler here: {unavailable}")
        library.exp_one.argtypes = [ctypes.c_float]
        library.exp_one.restype = ctypes.c_float
        yield library


def _pointer(array: np.ndarray) -> ctypes.c_void_p:
    return array.ctypes.data_as(ctypes.c_void_p)


def _exp(library: ctypes.CDLL, x: np.ndarray) -> np.ndarray:
    x = np.ascontiguousarray(x, dtype=np.float32)
    y = np.empty_like(x)
    library.exp_array(_pointer(x), _pointer(y), ctypes.c_int64(x.size))
    return y


def _floats_between(low: float, high: float, stride: int) -> np.ndarray:
    """Every stride-th float of [low, high] (low < 0 < high), by bit pattern, with both ends."""
    top = int(np.float32(high).view(np.uint32))
    bottom = int(np.float32(-low).view(np.uint32))
    positive = np.append(np.arange(0, top, stride, dtype=np.uint32), np.uint32(top))
    negative = np.append(np.arange(1, bottom, stride, dtype=np.uint32), np.uint32(bottom)) | np.uint32(0x80000000)
    return np.concatenate([positive, negative]).view(np.float32)


def test_the_exponential_is_within_about_one_ulp_over_its_range(math_library: ctypes.CDLL) -> None:
    x = _floats_between(-87.0, 88.72, stride=97)
    exact = np.exp(x.astype(np.float64))
    ulps = np.abs(_exp(math_library, x).astype(np.float64) - exact) / np.spacing(exact.astype(np.float32))
    worst = int(ulps.argmax())
    assert ulps[worst] < 1.01, f"exp({x[worst]!r}) is {ulps[worst]:.3f} ulp off"


def test_the_exponential_gives_the_same_bits_vectorised_and_alone(math_library: ctypes.CDLL) -> None:
    x = np.random.default_rng(0).uniform(-87.0, 88.72, 4099).astype(np.float32)
    together = _exp(math_library, x)
    alone = np.array([math_library.exp_one(float(value)) for value in x], dtype=np.float32)
    assert together.view(np.uint32).tolist() == alone.view(np.uint32).tolist()


def test_a_softmax_weight_below_the_range_is_zero_and_the_exponential_within_it(math_library: ctypes.CDLL) -> None:
    x = np.array([-np.inf, -3.4e38, -1000.0, -87.01, -87.0, -20.0, -1e-30, 0.0], dtype=np.float32)
    weights = np.empty_like(x)
    math_library.softmax_exp_array(_pointer(x), _pointer(weights), ctypes.c_int64(x.size))
    assert weights[:4].tolist() == [0.0] * 4
    assert weights[4:].view(np.uint32).tolist() == _exp(math_library, x[4:]).view(np.uint32).tolist()


def test_silu_times_up_matches_torch_at_the_extremes(math_library: ctypes.CDLL) -> None:
    gate = np.concatenate([np.linspace(-200.0, 200.0, 4001), [-88.8, -88.72, -88.7, -88.0, -87.9, 88.5, 1e-30, -1e-30, 0.0]])
    gate = gate.astype(np.float32)
    up = np.random.default_rng(1).uniform(-3.0, 3.0, gate.size).astype(np.float32)
    out = np.empty_like(gate)
    math_library.silu_mul_array(_pointer(gate), _pointer(up), _pointer(out), ctypes.c_int64(gate.size))
    expected = (torch.nn.functional.silu(torch.from_numpy(gate).double()) * torch.from_numpy(up).double()).numpy()
    assert np.isfinite(out).all()
    np.testing.assert_allclose(out, expected, rtol=1e-6, atol=1e-35)


def test_the_kernel_flags_let_no_compiler_change_a_result() -> None:
    value_changing = {"-ffast-math", "-Ofast", "-funsafe-math-optimizations", "-fassociative-math",
                      "-freciprocal-math", "-ffinite-math-only", "-ffp-contract=fast"}
    assert not value_changing & set(COMPILE_FLAGS)
    assert "-ffp-contract=off" in COMPILE_FLAGS
