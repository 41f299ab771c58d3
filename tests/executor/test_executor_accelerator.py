"""CUDA-only decisions, tested without a GPU: the attention backend and the KV budget arithmetic;
and, where torch sees a GPU, an executor built on it."""

from __future__ import annotations

import importlib.util
from pathlib import Path

import pytest
import torch

from executor_service.attention import paged_attention
from executor_service.attention.kv_cache import KVCacheShape
from executor_service.attention.paged_attention import select_backend
from executor_service.serving.settings import ExecutorSettings
from executor_service.startup.kv_budget import (
    CudaMemory,
    cuda_kv_blocks,
    gather_bytes_per_block,
)
from executor_service.startup.startup import build_executor
from protos.splitserve.executor.v1 import executor_pb2 as pb
from tests.helpers.model_factory import build_model

GIB = 1 << 30
CUDA = torch.device("cuda:0")


@pytest.fixture
def flash_attn_installed(monkeypatch: pytest.MonkeyPatch) -> None:
    real = importlib.util.find_spec
    monkeypatch.setattr(
        paged_attention.importlib.util,
        "find_spec",
        lambda name, *args: object() if name == "flash_attn" else real(name, *args),
    )


@pytest.mark.usefixtures("flash_attn_installed")
def test_flash_attn_only_for_half_precision_on_cuda() -> None:
    assert select_backend(CUDA, torch.bfloat16) == "flash_attn"
    assert select_backend(CUDA, torch.float16) == "flash_attn"
    assert select_backend(CUDA, torch.float32) == "sdpa"
    assert select_backend(torch.device("cpu"), torch.bfloat16) == "sdpa"


def test_without_flash_attn_cuda_uses_sdpa(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(paged_attention.importlib.util, "find_spec", lambda name, *args: None)
    assert select_backend(CUDA, torch.bfloat16) == "sdpa"
    with pytest.raises(ValueError, match="flash_attn needs CUDA"):
        select_backend(CUDA, torch.bfloat16, "flash_attn")


@pytest.mark.usefixtures("flash_attn_installed")
def test_a_requested_backend_overrides_auto() -> None:
    assert select_backend(CUDA, torch.bfloat16, "sdpa") == "sdpa"
    assert select_backend(CUDA, torch.bfloat16, "flash_attn") == "flash_attn"


def _memory(free: int, own: int = 10 * GIB, peak: int = 2 * GIB) -> CudaMemory:
    return CudaMemory(total_bytes=80 * GIB, free_bytes=free, own_bytes=own, step_peak_bytes=peak)


def test_kv_blocks_come_from_free_memory_when_others_hold_the_rest() -> None:
    # Another process holds 50 GiB: only the 20 GiB free count, less the step's peak.
    assert cuda_kv_blocks(_memory(free=20 * GIB), 0.9, GIB, 0) == 18


def test_kv_blocks_stay_under_the_utilization_cap() -> None:
    # 70 GiB free, but 0.5 x 80 GiB allows the process 40 GiB, 10 of which the weights hold.
    assert cuda_kv_blocks(_memory(free=70 * GIB), 0.5, GIB, 0) == 28


def test_kv_blocks_reserve_the_gather_and_never_go_negative() -> None:
    assert cuda_kv_blocks(_memory(free=20 * GIB), 0.9, GIB, GIB // 2) == 12
    assert cuda_kv_blocks(_memory(free=GIB), 0.9, GIB, 0) == 0


def test_gather_reserve_is_one_layer_and_the_sdpa_gqa_repeat() -> None:
    shape = KVCacheShape(
        num_layers=4, num_kv_heads=2, key_dim=8, value_dim=8, block_size=16, dtype=torch.float16
    )
    one_layer = shape.bytes_per_block() // 4
    assert gather_bytes_per_block(shape, "flash_attn", num_heads=8) == one_layer
    assert gather_bytes_per_block(shape, "sdpa", num_heads=8) == 5 * one_layer
    # Decode graphs gather into a pool of their own.
    assert gather_bytes_per_block(shape, "sdpa", num_heads=8, decode_graphs=True) == 6 * one_layer


@pytest.mark.skipif(not torch.cuda.is_available(), reason="torch sees no CUDA device")
def test_a_gpu_executor_sizes_its_cache_from_free_memory_and_serves(tmp_path: Path) -> None:
    """On a real GPU: the profiling pass, the budget with decode graphs reserved, and a request
    served through a graphed decode in bfloat16."""
    settings = ExecutorSettings(
        model_dir=build_model("llama", tmp_path / "llama"), device="cuda", gpu_memory_utilization=0.05
    )
    executor = build_executor(settings)
    assert executor.info.dtype == "bfloat16" and executor.info.num_kv_blocks > 1000
    runner = executor.runner
    assert runner.graphs is not None
    plan = pb.StepPlan(
        step_id=1,
        new_requests=[pb.NewRequest(request_id="r", token_ids=[5, 6, 7], block_ids=[0], num_scheduled_tokens=3)],
    )
    tokens = [runner.execute(plan).outputs[0].token_ids[0]]
    for step in range(2, 6):
        decode = pb.ContinuingRequest(request_id="r", num_scheduled_tokens=1)
        tokens += runner.execute(pb.StepPlan(step_id=step, continuing_requests=[decode])).outputs[0].token_ids
    # Every bucket was captured at start-up; the four decodes replayed one.
    assert len(tokens) == 5 and runner.graphs.enabled and runner.graphs.graphed_steps == 4
    assert runner.graphs.captured == sorted(runner.graphs.buckets()) and len(runner.graphs.captured) > 50
