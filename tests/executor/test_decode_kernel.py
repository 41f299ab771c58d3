"""The C decode kernel attends exactly as the written-out attention does, over K/V it reads
from the blocks; both CPU backends reproduce each model's own forward; and a machine where the
kernel cannot be built falls back to SDPA, or refuses cpu_paged when it was asked for."""

from __future__ import annotations

import ctypes
from pathlib import Path

import pytest
import torch

from executor_service.attention import decode_kernel, paged_attention
from executor_service.attention.attention_math import explicit_attention
from executor_service.attention.decode_kernel import load_decode_kernel
from executor_service.attention.kv_cache import KVCacheShape, PagedKVCache
from executor_service.attention.paged_attention import (
    BackendUnavailable,
    select_backend,
)
from executor_service.kernels.cpu_kernels import KernelUnavailable, build_kernel
from executor_service.model.model_loader import load_model
from executor_service.startup.self_check import run_self_check, self_check_reference
from tests.helpers.c_kernels import load_or_skip
from tests.helpers.model_factory import build_model

CPU = torch.device("cpu")
BLOCK = 16


def _kernel_or_skip() -> decode_kernel.DecodeKernel:
    return load_or_skip(load_decode_kernel)


@pytest.mark.parametrize(
    ("heads", "kv_heads", "key_dim", "value_dim", "window", "softcap", "sinks", "spread"),
    [
        (8, 4, 64, 64, None, None, False, 1.0),
        (8, 8, 128, 128, None, None, False, 1.0),
        (8, 2, 48, 32, 21, None, False, 1.0),
        (4, 1, 16, 16, None, 30.0, True, 1.0),
        (6, 3, 64, 64, 5, 50.0, True, 1.0),
        (8, 4, 64, 64, None, None, False, 40.0),
    ],
)
# 1 thread: a task walks every KV head of its sequence; 8 threads outnumber the 5 sequences, so
# a task is one KV head.
@pytest.mark.parametrize("threads", [1, 8])
def test_the_kernel_attends_as_the_written_out_attention_does(
    heads: int, kv_heads: int, key_dim: int, value_dim: int, window: int | None,
    softcap: float | None, sinks: bool, spread: float, threads: int,
) -> None:
    kernel = _kernel_or_skip()
    generator = torch.Generator().manual_seed(heads * key_dim + value_dim)
    num_blocks = 64
    key_cache = torch.randn(num_blocks * BLOCK, kv_heads, key_dim, generator=generator)
    value_cache = torch.randn(num_blocks * BLOCK, kv_heads, value_dim, generator=generator)
    # One token, a block exactly, one past it, and long contexts, in shuffled blocks.
    lengths = [1, BLOCK, BLOCK + 1, 100, 250]
    order = torch.randperm(num_blocks, generator=generator).tolist()
    tables = []
    for length in lengths:
        count = -(-length // BLOCK)
        tables.append(order[:count])
        order = order[count:]
    width = max(len(t) for t in tables)
    block_table = torch.tensor([t + [0] * (width - len(t)) for t in tables])
    queries = torch.randn(len(lengths), heads, key_dim, generator=generator)
    # spread 40: scores hundreds apart, so most weights underflow (kernels/softmax_exp.h).
    queries.mul_(spread)
    sink_logits = torch.randn(heads, generator=generator) if sinks else None
    scale = key_dim**-0.5
    before = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        got = kernel(
            queries, key_cache, value_cache, block_table, torch.tensor(lengths), BLOCK, scale,
            window, softcap, sink_logits,
        )
    finally:
        torch.set_num_threads(before)
    for row, (length, table) in enumerate(zip(lengths, tables)):
        positions = torch.arange(length)
        slots = torch.tensor(table)[positions // BLOCK] * BLOCK + positions % BLOCK
        allowed = torch.ones(1, length, dtype=torch.bool)
        if window is not None:
            allowed &= positions >= length - window
        expected = explicit_attention(
            queries[row][:, None, :],
            key_cache[slots].transpose(0, 1),
            value_cache[slots].transpose(0, 1),
            allowed,
            scale,
            softcap,
            sink_logits,
        )[:, 0]
        torch.testing.assert_close(got[row], expected, rtol=1e-5, atol=1e-5)


def test_the_kernel_refuses_tensors_it_cannot_read() -> None:
    kernel = _kernel_or_skip()
    cache = torch.zeros(4 * BLOCK, 2, 8)
    table, lengths = torch.zeros(1, 1, dtype=torch.long), torch.tensor([3])
    with pytest.raises(ValueError, match="float32"):
        kernel(torch.zeros(1, 4, 8, dtype=torch.float64), cache, cache, table, lengths, BLOCK, 1.0, None, None, None)
    with pytest.raises(ValueError, match="KV heads"):
        kernel(torch.zeros(1, 3, 8), cache, cache, table, lengths, BLOCK, 1.0, None, None, None)
    with pytest.raises(ValueError, match="one row per query"):
        kernel(torch.zeros(2, 4, 8), cache, cache, table, lengths, BLOCK, 1.0, None, None, None)


@pytest.mark.parametrize("arch", ["llama", "mistral", "gemma2", "gpt_oss", "qwen3"])
@pytest.mark.parametrize("backend", ["sdpa", "cpu_paged"])
def test_both_cpu_backends_reproduce_the_models_own_forward(
    arch: str, backend: str, tmp_path: Path
) -> None:
    # Sliding windows (mistral, gemma2), soft-capping (gemma2) and sinks (gpt_oss) included.
    if backend == "cpu_paged":
        _kernel_or_skip()
    loaded = load_model(build_model(arch, tmp_path / arch), device="cpu")
    shape = KVCacheShape(
        loaded.num_layers, loaded.num_kv_heads, loaded.key_dim, loaded.value_dim, BLOCK, loaded.dtype
    )
    reference = self_check_reference(loaded, BLOCK, 32)
    worst = run_self_check(loaded, PagedKVCache(shape, 32, CPU), backend, reference)
    assert worst < 1e-4


def test_without_a_compiler_auto_falls_back_to_sdpa_and_cpu_paged_is_refused(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    monkeypatch.setenv("CC", str(tmp_path / "no-such-compiler"))
    monkeypatch.setenv("SPLITSERVE_KERNEL_CACHE", str(tmp_path / "cache"))
    with pytest.raises(KernelUnavailable, match="no C compiler"):
        build_kernel()

    def unavailable() -> ctypes.CDLL:
        raise KernelUnavailable("no C compiler: 'cc' is not on PATH")

    monkeypatch.setattr(paged_attention, "load_kernel_library", unavailable)
    assert select_backend(CPU, torch.float32) == "sdpa"
    with pytest.raises(BackendUnavailable, match="no C compiler"):
        select_backend(CPU, torch.float32, "cpu_paged")
    with pytest.raises(BackendUnavailable, match="float32"):
        select_backend(CPU, torch.bfloat16, "cpu_paged")


def test_a_kernel_is_built_once_into_its_cache_and_a_broken_compiler_says_why(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    monkeypatch.setenv("SPLITSERVE_KERNEL_CACHE", str(tmp_path / "cache"))
    built = load_or_skip(build_kernel)
    assert built.parent == tmp_path / "cache" and built.is_file()
    stamp = built.stat().st_mtime_ns
    assert build_kernel() == built and built.stat().st_mtime_ns == stamp
    assert [p.name for p in (tmp_path / "cache").iterdir()] == [built.name]
    failing = tmp_path / "failing-cc"
    failing.write_text("#!/bin/sh\nif [ \"$1\" = --version ]; then echo fake 1.0; exit 0; fi\necho 'cc: error: out of disk' >&2\nexit 1\n")
    failing.chmod(0o755)
    monkeypatch.setenv("CC", str(failing))
    with pytest.raises(KernelUnavailable, match="out of disk"):
        build_kernel()
    assert [p.name for p in (tmp_path / "cache").iterdir()] == [built.name]
