"""The C kernels (the *.c files beside this module and the headers they include): built once per
machine into one shared library, loaded with ctypes. layer_kernels.py, argmax_kernel.py,
row_kernels.py and panel_linear.py here, attention/decode_kernel.py and attention/prefill_kernel.py, and
cpu_forward/greedy_head.py and cpu_forward/decode_program.py wrap its functions.

Plain C files need only the system's C compiler (no torch headers, no ninja) and build in about
a second.

The shared library is cached in a folder of this user's alone (kernel_cache.py: where, and what
is checked before anything there is loaded), keyed by the sources, the flags, the compiler and the
CPU's feature flags (it is built with -march=native), and is written under a temporary name and
renamed, so executors starting together never load half a file. A cached library that is refused
(not this user's alone, not loadable, missing a function) is logged once and rebuilt.
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
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import torch

from executor_service.kernels.kernel_cache import (
    library_refusal,
    log_refusal,
    private_cache_folder,
)

logger = logging.getLogger(__name__)

# The C sources lie beside this module, in the kernels package.
KERNEL_DIR = Path(__file__).parent
SOURCES = tuple(
    KERNEL_DIR / name
    for name in (
        "attention_chunk.c",
        "paged_decode.c",
        "paged_prefill.c",
        "layer_elementwise.c",
        "activations.c",
        "row_argmax.c",
        "greedy_screen.c",
        "panel_linear.c",
        "panel_amx.c",
        "decode_layers.c",
        "steady_rows.c",
    )
)
# Included by the sources, so part of the build key like them.
HEADERS = tuple(sorted(KERNEL_DIR.glob("*.h")))
# No -ffast-math: it would let the compiler reorder sums, fuse products and swap divisions for
# approximations as it sees fit, so a kernel's bits would belong to the compiler's version.
# -ffp-contract=off fuses only the products the kernels fuse themselves (vector_lanes.h);
# -fno-math-errno lets sqrtf be the correctly rounded instruction it is anyway, since no kernel
# reads errno; -fno-trapping-math lets a select compute both sides (vector_exp.h, silu_mul.h)
# without changing any result, only whether a floating-point exception flag could be raised.
# Reductions that vectorise write their order down (vector_lanes.h); the exponential is our own
# (vector_exp.h) rather than glibc's vector expf, which only -ffast-math turns on.
COMPILE_FLAGS = ("-O3", "-march=native", "-fopenmp", "-ffp-contract=off", "-fno-math-errno", "-fno-trapping-math", "-fPIC", "-std=gnu11")
LINK_FLAGS = ("-shared", "-fopenmp")
BUILD_TIMEOUT_S = 120.0
# Exported by every build whatever the CPU (those built for AVX-512 only are looked up by their
# wrappers where panel_linear_available says so): a library without one is not ours.
REQUIRED_SYMBOLS = (
    "paged_decode_attention",
    "paged_prefill_attention",
    "rms_norm",
    "silu_mul",
    "rope",
    "row_argmax",
    "quantize_rows",
    "screened_logits",
    "panel_linear_available",
    "panel_packed_floats",
    "panel_pack",
    "panel_amx_use",
    "steady_gather",
    "steady_decoded",
)


class KernelUnavailable(RuntimeError):
    """The kernel cannot be built or loaded here; the reason is the message."""


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


def kernel_library_name(compiler: str | None = None) -> str:
    """The cached library's file name on this machine: cpu-kernels-<build key>.so."""
    return f"cpu-kernels-{_build_key(compiler or _compiler())}.so"


def build_kernel() -> Path:
    """The shared library's path, compiled first when this machine has none cached (or has one
    that is refused)."""
    compiler = _compiler()
    target = _cache_folder() / kernel_library_name(compiler)
    if not _cached(target):
        with _fresh_build(target, compiler):
            pass
    return target


def open_kernel_library() -> ctypes.CDLL:
    """The library loaded from the cache, or built and loaded where the cache has none or a
    refused one; raises KernelUnavailable saying why it cannot be had."""
    compiler = _compiler()
    target = _cache_folder() / kernel_library_name(compiler)
    if _cached(target):
        try:
            return open_library(target)
        except KernelUnavailable as refused:
            log_refusal(target, str(refused))
    with _fresh_build(target, compiler) as built:
        # Loaded under its fresh name: the dynamic loader hands back a library it has loaded
        # from the same path before, which may be the one just refused.
        return open_library(built)


def open_library(path: Path) -> ctypes.CDLL:
    """The library at path, loaded, once it is known to export REQUIRED_SYMBOLS; else
    KernelUnavailable saying what is wrong with it."""
    try:
        library = ctypes.CDLL(str(path))
    except OSError as error:
        raise KernelUnavailable(f"cannot load {path}: {error}") from error
    missing = [name for name in REQUIRED_SYMBOLS if not hasattr(library, name)]
    if missing:
        raise KernelUnavailable(f"{path} lacks {', '.join(missing)}")
    return library


def _cache_folder() -> Path:
    folder = private_cache_folder()
    if folder is None:
        raise KernelUnavailable(
            "no folder of this user's alone to cache the kernels in (the refusals logged say why)"
        )
    return folder


def _cached(target: Path) -> bool:
    """Whether target is there to be loaded: absent, or refused (and logged), it is rebuilt."""
    if not os.path.lexists(target):
        return False
    reason = library_refusal(target)
    if reason is not None:
        log_refusal(target, reason)
    return reason is None


@contextmanager
def _fresh_build(target: Path, compiler: str) -> Iterator[Path]:
    """The library compiled in a private scratch folder beside target, for the caller's block;
    then moved to target, and the scratch folder removed whatever happened."""
    try:
        scratch = Path(tempfile.mkdtemp(dir=target.parent, prefix=".build-"))
    except OSError as error:
        raise KernelUnavailable(f"kernel cache {target.parent} is not writable: {error}") from error
    try:
        built = compile_library(SOURCES, scratch, compiler)
        yield built
        try:
            os.replace(built, target)
        except OSError as error:
            raise KernelUnavailable(f"cannot put the library at {target}: {error}") from error
        logger.info("event=cpu_kernels_built path=%s", target)
    finally:
        shutil.rmtree(scratch, ignore_errors=True)


def compile_library(
    sources: tuple[Path, ...] | list[Path],
    directory: Path,
    compiler: str | None = None,
    flags: tuple[str, ...] = COMPILE_FLAGS,
) -> Path:
    """sources compiled with flags (the kernels' own by default) and linked into
    directory/cpu-kernels.so (its path); the compiler defaults to $CC, else cc. Raises
    KernelUnavailable saying what failed."""
    compiler = compiler or _compiler()
    objects = [directory / f"{source.stem}.o" for source in sources]
    for source, obj in zip(sources, objects, strict=True):
        _run([compiler, *flags, "-c", str(source), "-o", str(obj)])
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


def load_kernel_library() -> ctypes.CDLL:
    """The library, built if needed; raises KernelUnavailable saying why it cannot be had.

    Once per process, failure included: a loaded shared library is process-wide and immutable,
    so one load serves every step, and each wrapper asks for it at start, so a refusal or a failed
    build is logged and tried once, not once per wrapper.
    """
    outcome = _library_or_reason()
    if isinstance(outcome, KernelUnavailable):
        raise KernelUnavailable(str(outcome))
    return outcome


@functools.cache
def _library_or_reason() -> ctypes.CDLL | KernelUnavailable:
    try:
        return open_kernel_library()
    except KernelUnavailable as error:
        return error
