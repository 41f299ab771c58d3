"""Loading a C kernel in a test: skipped only where this machine cannot have it (no C compiler,
or a CPU without the instructions the kernel needs); where it could, a kernel that fails to
build or load fails the test, so a compile error in kernels/*.c cannot pass as a skip."""

from __future__ import annotations

import os
import shutil
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import TypeVar

import pytest

from executor_service.kernels.cpu_kernels import KernelUnavailable, cpu_flags
from executor_service.kernels.panel_linear import PanelKernel, load_panel_kernel

T = TypeVar("T")


def load_or_skip(load: Callable[[], T], cpu_flag: str | None = None) -> T:
    """load(), or a skip saying why this machine cannot have the kernel. cpu_flag: a
    /proc/cpuinfo flag the kernel needs (avx512f for the panel kernel)."""
    compiler = os.environ.get("CC", "cc")
    if shutil.which(compiler) is None:
        pytest.skip(f"no C compiler ({compiler!r} is not on PATH): the C kernels cannot be built here")
    if cpu_flag is not None and cpu_flag not in cpu_flags():
        pytest.skip(f"this CPU lacks {cpu_flag}, which the kernel needs")
    try:
        return load()
    except KernelUnavailable as error:
        pytest.fail(f"the kernel could be built here, but: {error}")


def skip_without_amx() -> None:
    """A skip where the CPU lacks AMX's bf16 tiles, which the panel kernel's AMX path needs."""
    if not {"amx_bf16", "amx_tile"} <= cpu_flags():
        pytest.skip("this CPU lacks AMX's bf16 tiles")


@contextmanager
def amx_off(kernel: PanelKernel) -> Iterator[None]:
    """The float path for the block's calls: with AMX on, every call multiplies on its tiles, to
    float32 accuracy but not the float path's bits (test_panel_amx.py, test_panel_amx_floats.py).
    AMX is on again after, as executors start it."""
    kernel.use_amx(False)
    try:
        yield
    finally:
        kernel.use_amx(True)


def panels_without_amx() -> Iterator[PanelKernel]:
    """The panel kernel with AMX off until the generator is closed, for a fixture to yield."""
    kernel = load_or_skip(load_panel_kernel, cpu_flag="avx512f")
    with amx_off(kernel):
        yield kernel


def panels_with_amx() -> Iterator[PanelKernel]:
    """The panel kernel with AMX on, for a fixture to yield; skipped only on CPUs without AMX, and
    a CPU with it whose kernel does not turn it on fails."""
    kernel = load_or_skip(load_panel_kernel, cpu_flag="avx512f")
    skip_without_amx()
    if not kernel.use_amx(True):
        pytest.fail("the CPU has AMX, but the kernel could not turn it on (compiler without AMX, or the OS refused)")
    try:
        yield kernel
    finally:
        kernel.use_amx(True)
