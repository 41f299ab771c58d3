"""Fused Llama layers (one QKV GEMM, one gate-and-up GEMM, RoPE over Q and K at once, torch's
rms_norm) give the packed model's logits, and leave other architectures alone. The arithmetic
per element is the same, so they were equal bit for bit where measured; the tolerance allows
only for oneDNN choosing another summation order for the wider GEMMs on another CPU."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from transformers import AutoModelForCausalLM

from executor_service.fused_layers import (
    FusedAttention,
    FusedMLP,
    FusedRMSNorm,
    fuse_layers,
)
from executor_service.packed_linear import pack_linears, packing_available
from tests.helpers.model_factory import build_model

pytestmark = pytest.mark.skipif(
    not packing_available(torch.device("cpu"), torch.float32), reason="no oneDNN in this torch"
)


def _packed_model(model_dir: Path, fused: bool) -> torch.nn.Module:
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    if fused:
        fuse_layers(model)
    pack_linears(model)
    return model


def test_fused_llama_layers_give_the_packed_models_logits(tmp_path: Path) -> None:
    model_dir = build_model("llama", tmp_path / "llama")
    packed = _packed_model(model_dir, fused=False)
    fused = _packed_model(model_dir, fused=True)
    layers = fused.config.num_hidden_layers
    kinds = [type(m) for m in fused.modules()]
    assert kinds.count(FusedAttention) == kinds.count(FusedMLP) == layers
    # Two norms per layer and the final one.
    assert kinds.count(FusedRMSNorm) == 2 * layers + 1
    generator = torch.Generator().manual_seed(0)
    with torch.inference_mode():
        for shape in [(3, 37), (1, 1), (1, 300)]:
            prompt = torch.randint(3, 1000, shape, generator=generator)
            expected = packed(prompt, use_cache=False).logits
            torch.testing.assert_close(fused(prompt, use_cache=False).logits, expected, rtol=1e-5, atol=1e-5)
        with pytest.raises(NotImplementedError, match="use_cache=False"):
            fused(prompt, use_cache=True)


@pytest.mark.parametrize("arch", ["qwen2", "qwen3", "mistral"])
def test_architectures_not_known_to_compute_the_same_keep_their_own_layers(arch: str, tmp_path: Path) -> None:
    # Biased projections, Q/K norms and sliding windows are not what the fused forward does.
    model = AutoModelForCausalLM.from_pretrained(build_model(arch, tmp_path / arch)).eval()
    assert fuse_layers(model) == 0
