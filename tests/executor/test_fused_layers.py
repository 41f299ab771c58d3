"""Fused Llama layers (one QKV GEMM, one gate-and-up GEMM, RoPE over Q and K at once, one
RMSNorm), with the C elementwise passes or torch's operations, give the packed model's logits,
and leave other architectures alone. The arithmetic per element is the same; the tolerance
allows for oneDNN's summation order in the wider GEMMs and the C passes' float32 roundings."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from transformers import AutoModelForCausalLM

from executor_service.cpu_forward.fused_layers import (
    FusedAttention,
    FusedMLP,
    FusedRMSNorm,
    fuse_layers,
)
from executor_service.cpu_forward.packed_linear import pack_linears, packing_available
from executor_service.kernels.layer_kernels import LayerKernels, load_layer_kernels
from tests.helpers.c_kernels import load_or_skip
from tests.helpers.model_factory import build_model

pytestmark = pytest.mark.skipif(
    not packing_available(torch.device("cpu"), torch.float32), reason="no oneDNN in this torch"
)


def _layer_kernels_or_skip() -> LayerKernels:
    return load_or_skip(load_layer_kernels)


def _packed_model(model_dir: Path, fused: bool, kernels: LayerKernels | None = None) -> torch.nn.Module:
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    if fused:
        fuse_layers(model, kernels)
    pack_linears(model)
    return model


@pytest.mark.parametrize("elementwise", ["c", "torch"])
def test_fused_llama_layers_give_the_packed_models_logits(elementwise: str, tmp_path: Path) -> None:
    kernels = _layer_kernels_or_skip() if elementwise == "c" else None
    model_dir = build_model("llama", tmp_path / "llama")
    packed = _packed_model(model_dir, fused=False)
    fused = _packed_model(model_dir, fused=True, kernels=kernels)
    layers = fused.config.num_hidden_layers
    kinds = [type(m) for m in fused.modules()]
    assert kinds.count(FusedAttention) == kinds.count(FusedMLP) == layers
    # Two norms per layer and the final one.
    assert kinds.count(FusedRMSNorm) == 2 * layers + 1
    # torch's operations round as transformers' do; the C passes sum squares and take the
    # exponential in another order (~1.5e-5 on these logits of ~1).
    tolerance = 1e-4 if kernels is not None else 1e-5
    generator = torch.Generator().manual_seed(0)
    with torch.inference_mode():
        for shape in [(3, 37), (1, 1), (1, 300)]:
            prompt = torch.randint(3, 1000, shape, generator=generator)
            expected = packed(prompt, use_cache=False).logits
            got = fused(prompt, use_cache=False).logits
            torch.testing.assert_close(got, expected, rtol=tolerance, atol=tolerance)
        with pytest.raises(NotImplementedError, match="use_cache=False"):
            fused(prompt, use_cache=True)


@pytest.mark.parametrize("arch", ["qwen2", "qwen3", "mistral"])
def test_architectures_not_known_to_compute_the_same_keep_their_own_layers(arch: str, tmp_path: Path) -> None:
    # Biased projections, Q/K norms and sliding windows are not what the fused forward does.
    model = AutoModelForCausalLM.from_pretrained(build_model(arch, tmp_path / arch)).eval()
    assert fuse_layers(model, None) == 0


# 32 rows of 576 run on the calling thread; 2,048 rows are split between threads.
@pytest.mark.parametrize("rows", [1, 32, 2048])
def test_the_c_passes_compute_what_torchs_operations_compute(rows: int) -> None:
    kernels = _layer_kernels_or_skip()
    generator = torch.Generator().manual_seed(rows)
    x = torch.randn(rows, 576, generator=generator) * 3
    weight = torch.randn(576, generator=generator)
    expected = weight * (x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + 1e-5))
    torch.testing.assert_close(kernels.rms_norm(x, weight, 1e-5), expected, rtol=1e-5, atol=1e-5)

    gate_up = torch.randn(rows, 2 * 1536, generator=generator) * 4
    expected = torch.nn.functional.silu(gate_up[:, :1536]) * gate_up[:, 1536:]
    torch.testing.assert_close(kernels.silu_mul(gate_up), expected, rtol=1e-5, atol=1e-5)

    # Q and K heads at the start of packed QKV rows, as the fused attention holds them.
    qkv = torch.randn(rows, (9 + 3 + 3) * 64, generator=generator)
    angles = torch.randn(rows, 32, generator=generator) * 10
    cos, sin = torch.cat([angles.cos()] * 2, -1), torch.cat([angles.sin()] * 2, -1)
    qk = qkv[:, : 12 * 64].view(rows, 12, 64)
    rotated = torch.cat((-qk[..., 32:], qk[..., :32]), dim=-1)
    expected = qk * cos[:, None] + rotated * sin[:, None]
    values = qkv[:, 12 * 64 :].clone()
    kernels.rope_(qk, cos, sin)
    torch.testing.assert_close(qk, expected, rtol=1e-5, atol=1e-5)
    assert torch.equal(qkv[:, 12 * 64 :], values)

    with pytest.raises(ValueError, match="float32"):
        kernels.silu_mul(gate_up.double())
    with pytest.raises(ValueError, match="even width"):
        kernels.rope_(qkv[:, :63].view(rows, 1, 63), cos[:, :63], sin[:, :63])
