"""Linear layers packed for the panel kernel or for oneDNN compute what the plain layers compute,
and nothing reads the plain weights they replace."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from torch import nn
from transformers import AutoModelForCausalLM

from executor_service.cpu_forward.packed_linear import (
    PackedLinear,
    pack_linears,
    packing_available,
)
from executor_service.kernels.panel_linear import PanelKernel, load_panel_kernel
from tests.helpers.c_kernels import load_or_skip
from tests.helpers.model_factory import build_model

pytestmark = pytest.mark.skipif(
    not packing_available(torch.device("cpu"), torch.float32), reason="no oneDNN in this torch"
)


def backend(name: str) -> PanelKernel | None:
    """The panel kernel for "panels", None (oneDNN) for "onednn"."""
    if name == "onednn":
        return None
    return load_or_skip(load_panel_kernel, cpu_flag="avx512f")


@pytest.mark.parametrize("backend_name", ["panels", "onednn"])
@pytest.mark.parametrize("arch", ["llama", "qwen2"])
def test_a_packed_model_gives_the_plain_models_logits_and_tokens(arch: str, backend_name: str, tmp_path: Path) -> None:
    # qwen2 has biased q/k/v projections; llama none.
    model_dir = build_model(arch, tmp_path / arch)
    plain = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    packed = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    linears = sum(type(m) is nn.Linear for m in packed.modules())
    assert pack_linears(packed, backend(backend_name)) == linears > 0
    assert not any(type(m) is nn.Linear for m in packed.modules())
    prompt = torch.randint(3, 1000, (3, 37), generator=torch.Generator().manual_seed(0))
    with torch.inference_mode():
        expected = plain(prompt).logits
        got = packed(prompt).logits
        torch.testing.assert_close(got, expected, rtol=1e-4, atol=1e-4)
        greedy = dict(max_new_tokens=12, do_sample=False, pad_token_id=0)
        assert torch.equal(packed.generate(prompt, **greedy), plain.generate(prompt, **greedy))


@pytest.mark.parametrize("backend_name", ["panels", "onednn"])
def test_packing_keeps_the_models_device_and_shapes_and_refuses_reads_of_old_weights(
    backend_name: str, tmp_path: Path
) -> None:
    model = AutoModelForCausalLM.from_pretrained(build_model("llama", tmp_path / "m")).eval()
    head_shape = model.lm_head.weight.shape
    pack_linears(model, backend(backend_name))
    assert model.device == torch.device("cpu")
    assert isinstance(model.lm_head, PackedLinear)
    assert model.get_output_embeddings().weight.shape == head_shape
    with pytest.raises((NotImplementedError, RuntimeError)):
        model.lm_head.weight.sum().item()


def test_only_float32_on_cpu_is_packed() -> None:
    assert not packing_available(torch.device("cpu"), torch.float16)
    assert not packing_available(torch.device("cpu"), torch.bfloat16)
    assert not packing_available(torch.device("cuda"), torch.float32)
