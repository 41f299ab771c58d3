"""The C decode attention kernel (kernels/paged_decode.c): built once per machine, loaded with
ctypes, called on the tensors' memory.

Why C: a decode step attends each sequence over its whole context, and in torch that means
gathering every context from its blocks into a padded copy per layer (32 sequences of ~340
tokens: ~200 MB written and read again per step of the random-Llama benchmark, 24 of its 65 ms).
The kernel reads each K and V row once, where it lies. A plain C file needs only the system's C
compiler (no torch headers, no ninja) and builds in well under a second.

The shared library is cached under $SPLITSERVE_KERNEL_CACHE (default
$XDG_CACHE_HOME/splitserve/kernels, else ~/.cache/splitserve/kernels), keyed by the source,
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

import torch

logger = logging.getLogger(__name__)

SOURCE = Path(__file__).with_name("kernels") / "paged_decode.c"
# -ffast-math lets the exponentials and reductions vectorise (glibc's vector expf). Compiling
# and linking are separate steps so that the link, without -ffast-math, does not pull in
# crtfastmath.o, which would switch the whole process to flush-denormals-to-zero on load.
COMPILE_FLAGS = ("-O3", "-march=native", "-fopenmp", "-ffast-math", "-fPIC", "-std=gnu11")
LINK_FLAGS = ("-shared", "-fopenmp")
BUILD_TIMEOUT_S = 120.0


class KernelUnavailable(RuntimeError):
    """The kernel cannot be built or loaded here; the reason is the message."""


class DecodeKernel:
    """paged_decode_attention, with its argument types declared once."""

    def __init__(self, library: Path) -> None:
        try:
            self._library = ctypes.CDLL(str(library))
        except OSError as error:
            raise KernelUnavailable(f"cannot load {library}: {error}") from error
        function = self._library.paged_decode_attention
        function.argtypes = [ctypes.c_void_p] * 7 + [ctypes.c_int64] * 7 + [
            ctypes.c_float,
            ctypes.c_int64,
            ctypes.c_float,
            ctypes.c_int,
        ]
        function.restype = ctypes.c_int
        self._function = function
        self.path = library

    def __call__(
        self,
        queries: torch.Tensor,
        key_cache: torch.Tensor,
        value_cache: torch.Tensor,
        block_table: torch.Tensor,
        context_lens: torch.Tensor,
        block_size: int,
        scale: float,
        window: int | None,
        softcap: float | None,
        sinks: torch.Tensor | None,
    ) -> torch.Tensor:
        """queries [batch, heads, key_dim] over the cache -> [batch, heads, value_dim].

        The C code trusts shapes and memory layout, so they are checked here; that every block
        id lies in the cache and every context fits its table is checked once per step, where
        the table is built (attention_metadata.paged_decode).
        """
        batch, heads, key_dim = queries.shape
        kv_heads, value_dim = key_cache.shape[1], value_cache.shape[2]
        tensors = (queries, key_cache, value_cache)
        if any(t.dtype != torch.float32 or not t.is_contiguous() for t in tensors):
            raise ValueError("the decode kernel takes contiguous float32 queries and cache")
        if key_cache.shape[2] != key_dim or heads % kv_heads:
            raise ValueError(
                f"queries {tuple(queries.shape)} do not fit a cache of {kv_heads} KV heads "
                f"of width {key_cache.shape[2]}"
            )
        if block_table.dtype != torch.int64 or context_lens.dtype != torch.int64:
            raise ValueError("block table and context lengths must be int64")
        if block_table.shape[0] != batch or context_lens.shape != (batch,):
            raise ValueError("block table and context lengths need one row per query")
        block_table = block_table.contiguous()
        context_lens = context_lens.contiguous()
        if sinks is not None:
            sinks = sinks.to(torch.float32).contiguous()
        out = queries.new_empty(batch, heads, value_dim)
        failed = self._function(
            queries.data_ptr(),
            key_cache.data_ptr(),
            value_cache.data_ptr(),
            block_table.data_ptr(),
            context_lens.data_ptr(),
            sinks.data_ptr() if sinks is not None else None,
            out.data_ptr(),
            batch,
            heads,
            kv_heads,
            key_dim,
            value_dim,
            block_size,
            block_table.shape[1],
            scale,
            window or 0,
            softcap or 0.0,
            torch.get_num_threads(),
        )
        if failed:
            raise MemoryError("the decode kernel could not allocate its scratch memory")
        return out


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
    for part in (SOURCE.read_bytes(), flags, version.encode(), _cpu_features()):
        digest.update(part)
        digest.update(b"\0")
    return digest.hexdigest()[:16]


def _cpu_features() -> bytes:
    """What -march=native depends on: the architecture and, on Linux, the CPU's feature flags."""
    features = platform.machine().encode()
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith(("flags", "Features")):
                return features + line.encode()
    except OSError:
        pass
    return features + platform.processor().encode()


def build_kernel() -> Path:
    """The shared library's path, compiled first when this machine has none cached."""
    compiler = _compiler()
    directory = kernel_cache_dir()
    target = directory / f"paged_decode-{_build_key(compiler)}.so"
    if target.is_file():
        return target
    try:
        directory.mkdir(parents=True, exist_ok=True)
        scratch = Path(tempfile.mkdtemp(dir=directory, prefix=".build-"))
    except OSError as error:
        raise KernelUnavailable(f"kernel cache {directory} is not writable: {error}") from error
    try:
        obj, library = scratch / "paged_decode.o", scratch / "paged_decode.so"
        _run([compiler, *COMPILE_FLAGS, "-c", str(SOURCE), "-o", str(obj)])
        _run([compiler, *LINK_FLAGS, str(obj), "-o", str(library), "-lm"])
        os.replace(library, target)
    finally:
        shutil.rmtree(scratch, ignore_errors=True)
    logger.info("event=decode_kernel_built path=%s", target)
    return target


def _run(command: list[str]) -> None:
    try:
        done = subprocess.run(command, capture_output=True, text=True, timeout=BUILD_TIMEOUT_S)
    except (OSError, subprocess.SubprocessError) as error:
        raise KernelUnavailable(f"{' '.join(command)} failed: {error}") from error
    if done.returncode != 0:
        raise KernelUnavailable(f"{' '.join(command)} failed: {done.stderr.strip()[-500:]}")


@functools.cache
def load_decode_kernel() -> DecodeKernel:
    """The kernel, built if needed; raises KernelUnavailable saying why it cannot be had.

    Cached: a loaded shared library is process-wide and immutable, so one load serves every
    step; a failure is not cached and is retried by the next caller.
    """
    return DecodeKernel(build_kernel())
