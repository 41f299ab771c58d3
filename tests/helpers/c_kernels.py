"""Loading a C kernel in a test: skipped only where this machine cannot have it (no C compiler,
or a CPU without the instructions the kernel needs); where it could, a kernel that fails to
build or load fails the test, so a compile error in kernels/*.c cannot pass as a skip."""

from __future__ import annotations

import os
import shutil
from collections.abc import Callable
from typing import TypeVar

import pytest

from executor_service.cpu_kernels import KernelUnavailable, cpu_flags

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
