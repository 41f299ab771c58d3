"""bench.same_bits tells an invariant executor from one that is not: on the CPU's default path a
probe gets the same bits batched, chunked and recomputed; through SDPA (decode and prefill add in
other orders, as on CUDA) it does not."""

from __future__ import annotations

from pathlib import Path

import pytest

from bench.same_bits import measure_configuration
from executor_service.attention.decode_kernel import load_decode_kernel
from tests.helpers.c_kernels import load_or_skip
from tests.helpers.model_factory import VOCAB_SIZE, build_model


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return build_model("llama", tmp_path_factory.mktemp("same-bits") / "llama", seed=3)


def _ways(model_dir: Path, backend: str) -> dict[str, bool]:
    results = measure_configuration(model_dir, VOCAB_SIZE, max_model_len=256, attention_backend=backend)
    return {way: result.same_bits for way, result in results.items()}


def test_the_default_cpu_path_gives_the_same_bits_every_way(model_dir: Path) -> None:
    load_or_skip(load_decode_kernel)
    assert _ways(model_dir, "cpu_paged") == {"batched": True, "chunked": True, "recomputed": True}


def test_sdpa_attention_is_reported_batch_dependent(model_dir: Path) -> None:
    assert not all(_ways(model_dir, "sdpa").values())
