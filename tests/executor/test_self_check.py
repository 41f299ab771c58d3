"""The start-up self-check holds what the executor replaces of a model to the model as
transformers built it: a fused layer or packed GEMM (the head's included) that computes the wrong
thing is refused before the executor serves, and the executor's own fused, packed path passes."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from executor_service.attention.kv_cache import KVCacheShape, PagedKVCache
from executor_service.attention.paged_attention import select_backend
from executor_service.cpu_forward.fused_layers import fuse_layers
from executor_service.cpu_forward.lean_forward import lean_llama
from executor_service.cpu_forward.packed_linear import pack_linears, packing_available
from executor_service.kernels.cpu_kernels import KernelUnavailable
from executor_service.kernels.layer_kernels import load_layer_kernels
from executor_service.model.model_loader import LoadedModel, load_model
from executor_service.model.model_support import UnsupportedModel
from executor_service.startup.self_check import run_self_check, self_check_reference
from tests.helpers.model_factory import build_model

BLOCK = 16
NUM_BLOCKS = 32


def _prepared(tmp_path: Path, damage: str | None) -> tuple[LoadedModel, float | None]:
    """A random Llama, its self-check reference taken, then (after `damage`'s weight is scaled by
    1 %, as a packing or kernel bug would) fused and packed as the executor does; the self-check's
    worst error, or None where it refused."""
    loaded = load_model(build_model("llama", tmp_path / "llama"), device="cpu")
    if not packing_available(loaded.device, loaded.dtype):
        pytest.skip("weights cannot be packed on this CPU")
    reference = self_check_reference(loaded, BLOCK, NUM_BLOCKS)
    if damage is not None:
        with torch.no_grad():
            loaded.model.get_submodule(damage).weight.mul_(1.01)
    try:
        kernels = load_layer_kernels()
    except KernelUnavailable:
        kernels = None
    fuse_layers(loaded.model, kernels)
    pack_linears(loaded.model)
    loaded.lean = lean_llama(loaded.model)
    shape = KVCacheShape(loaded.num_layers, loaded.num_kv_heads, loaded.key_dim, loaded.value_dim, BLOCK, loaded.dtype)
    cache = PagedKVCache(shape, NUM_BLOCKS, loaded.device)
    backend = select_backend(loaded.device, loaded.dtype, "auto")
    try:
        return loaded, run_self_check(loaded, cache, backend, reference)
    except UnsupportedModel as refused:
        assert "does not reproduce the model's own forward" in str(refused)
        return loaded, None


def test_the_fused_and_packed_model_passes(tmp_path: Path) -> None:
    _, worst = _prepared(tmp_path, None)
    assert worst is not None and worst < 1e-4


@pytest.mark.parametrize("damage", ["lm_head", "model.layers.1.mlp.down_proj", "model.layers.0.input_layernorm"])
def test_a_wrong_packed_or_fused_layer_is_refused(tmp_path: Path, damage: str) -> None:
    _, worst = _prepared(tmp_path, damage)
    assert worst is None
