"""The C kernels (kernels/*.c and the headers they include): built once per machine into one
shared library, loaded with ctypes. decode_kernel.py, prefill_kernel.py, layer_kernels.py,
argmax_kernel.py, greedy_head.py, panel_linear.py and decode_program.py wrap its functions.

Plain C files need only the system's C compiler (no torch headers, no ninja) and build in about
a second.

The shared library is cached under $SPLITSERVE_KERNEL_CACHE (default
$XDG_CACHE_HOME/splitserve/kernels, else ~/.cache/splitserve/kernels), keyed by the sources,
the flags, the compiler and the CPU's feature flags (it is built with -march=native), and is
written under a temporary name and renamed, so executors starting together never load half a
file.
"""

from __future__ import annotations

import ctypes
import functools
import hashlib
import logging
import os
import platform
import shutil
import subprocess
import tempfile
from pathlib import Path
from typing import Any

import torch

logger = logging.getLogger(__name__)

KERNEL_DIR = Path(__file__).with_name("kernels")
SOURCES = tuple(
    KERNEL_DIR / name
    for name in (
        "paged_decode.c",
        "paged_prefill.c",
        "layer_elementwise.c",
        "row_argmax.c",
        "greedy_screen.c",
        "panel_linear.c",
        "panel_amx.c",
        "decode_layers.c",
    )
)
# Included by the sources, so part of the build key like them.
HEADERS = tuple(sorted(KERNEL_DIR.glob("*.h")))
# -ffast-math lets the exponentials and reductions vectorise (glibc's vector expf). Compiling
# and linking are separate steps so that the link, without -ffast-math, does not pull in
# crtfastmath.o, which would switch the whole process to flush-denormals-to-zero on load.
COMPILE_FLAGS = ("-O3", "-march=native", "-fopenmp", "-ffast-math", "-fPIC", "-std=gnu11")
LINK_FLAGS = ("-shared", "-fopenmp")
BUILD_TIMEOUT_S = 120.0


class KernelUnavailable(RuntimeError):
    """The kernel cannot be built or loaded here; the reason is the message."""


def kernel_cache_dir() -> Path:
    explicit = os.environ.get("SPLITSERVE_KERNEL_CACHE")
    if explicit:
        return Path(explicit)
    base = os.environ.get("XDG_CACHE_HOME")
    if not base:
        try:
            base = str(Path.home() / ".cache")
        except RuntimeError:  # no home directory (some containers run as an unnamed uid)
            base = tempfile.gettempdir()
    return Path(base) / "splitserve" / "kernels"


def _compiler() -> str:
    name = os.environ.get("CC", "cc")
    path = shutil.which(name)
    if path is None:
        raise KernelUnavailable(f"no C compiler: {name!r} is not on PATH (set CC)")
    return path


def _build_key(compiler: str) -> str:
    try:
        version = subprocess.run(
            [compiler, "--version"], capture_output=True, text=True, timeout=30, check=True
        ).stdout
    except (OSError, subprocess.SubprocessError) as error:
        raise KernelUnavailable(f"{compiler} --version failed: {error}") from error
    digest = hashlib.sha256()
    flags = " ".join((*COMPILE_FLAGS, *LINK_FLAGS)).encode()
    for part in (*(path.read_bytes() for path in (*SOURCES, *HEADERS)), flags, version.encode(), _cpu_features()):
        digest.update(part)
        digest.update(b"\0")
    return digest.hexdigest()[:16]


def _cpu_features() -> bytes:
    """What -march=native depends on: the architecture and, on Linux, the CPU's feature flags."""
    features = platform.machine().encode()
    line = _cpuinfo_flags_line()
    return features + (line.encode() if line is not None else platform.processor().encode())


def _cpuinfo_flags_line() -> str | None:
    """The feature-flags line of /proc/cpuinfo ("flags" on x86, "Features" on Arm), or None."""
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith(("flags", "Features")):
                return line
    except OSError:
        pass
    return None


def cpu_flags() -> set[str]:
    """The CPU's feature flags (avx512f, ...) as /proc/cpuinfo lists them; empty where it cannot
    be read."""
    line = _cpuinfo_flags_line()
    return set(line.split(":", 1)[1].split()) if line is not None else set()


def build_kernel() -> Path:
    """The shared library's path, compiled first when this machine has none cached."""
    compiler = _compiler()
    directory = kernel_cache_dir()
    target = directory / f"cpu-kernels-{_build_key(compiler)}.so"
    if target.is_file():
        return target
    try:
        directory.mkdir(parents=True, exist_ok=True)
        scratch = Path(tempfile.mkdtemp(dir=directory, prefix=".build-"))
    except OSError as error:
        raise KernelUnavailable(f"kernel cache {directory} is not writable: {error}") from error
    try:
        os.replace(compile_library(SOURCES, scratch, compiler), target)
    finally:
        shutil.rmtree(scratch, ignore_errors=True)
    logger.info("event=cpu_kernels_built path=%s", target)
    return target


def compile_library(sources: tuple[Path, ...] | list[Path], directory: Path, compiler: str | None = None) -> Path:
    """sources compiled with the kernels' flags and linked into directory/cpu-kernels.so (its
    path); the compiler defaults to $CC, else cc. Raises KernelUnavailable saying what failed."""
    compiler = compiler or _compiler()
    objects = [directory / f"{source.stem}.o" for source in sources]
    for source, obj in zip(sources, objects, strict=True):
        _run([compiler, *COMPILE_FLAGS, "-c", str(source), "-o", str(obj)])
    library = directory / "cpu-kernels.so"
    _run([compiler, *LINK_FLAGS, *map(str, objects), "-o", str(library), "-lm"])
    return library


def _run(command: list[str]) -> None:
    try:
        done = subprocess.run(command, capture_output=True, text=True, timeout=BUILD_TIMEOUT_S)
    except (OSError, subprocess.SubprocessError) as error:
        raise KernelUnavailable(f"{' '.join(command)} failed: {error}") from error
    if done.returncode != 0:
        raise KernelUnavailable(f"{' '.join(command)} failed: {done.stderr.strip()[-500:]}")


def declare(function: Any, argtypes: list[Any], restype: Any) -> Any:
    """`function` from the library, with its C signature declared for ctypes' conversions."""
    function.argtypes = argtypes
    function.restype = restype
    return function


def float32_cpu(tensor: torch.Tensor, kernel: str) -> torch.Tensor:
    """tensor, when it is float32 on the CPU (all the C kernels take); else a ValueError saying
    what `kernel` (the caller's name for itself) was given."""
    if tensor.dtype != torch.float32 or tensor.device.type != "cpu":
        raise ValueError(f"{kernel}: float32 CPU tensors only, not {tensor.dtype} on {tensor.device}")
    return tensor


def pointer_or_none(tensor: torch.Tensor | None) -> int | None:
    """An optional operand's address for a C kernel: NULL (None) where there is none."""
    return None if tensor is None else tensor.data_ptr()


def attention_function(library: ctypes.CDLL, name: str, pointers: int, sizes: int) -> Any:
    """`name` from the library with its arguments declared: both attention kernels take
    `pointers` tensors (void *), `sizes` int64 sizes, then scale, window, soft-cap and thread
    count, and return 0, or 1 when their scratch memory could not be had."""
    tail = [ctypes.c_float, ctypes.c_int64, ctypes.c_float, ctypes.c_int]
    argtypes = [ctypes.c_void_p] * pointers + [ctypes.c_int64] * sizes + tail
    return declare(getattr(library, name), argtypes, ctypes.c_int)


@functools.cache
def load_kernel_library() -> ctypes.CDLL:
    """The library, built if needed; raises KernelUnavailable saying why it cannot be had.

    Cached: a loaded shared library is process-wide and immutable, so one load serves every
    step; a failure is not cached and is retried by the next caller.
    """
    library = build_kernel()
    try:
        return ctypes.CDLL(str(library))
    except OSError as error:
        raise KernelUnavailable(f"cannot load {library}: {error}") from error
