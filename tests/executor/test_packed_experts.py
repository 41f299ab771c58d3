"""Mixture-of-experts layers on packed experts and routers compute what transformers' do, and a
token's output has the same bits alone as beside any other tokens (issue 35)."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from torch import nn
from transformers import AutoModelForCausalLM, PreTrainedModel

from executor_service.cpu_forward.kernel_activations import install_kernel_activations
from executor_service.cpu_forward.packed_experts import EXPERTS_NAME, pack_experts
from executor_service.cpu_forward.packed_linear import pack_linears, packing_available
from executor_service.cpu_forward.packed_routers import PackedRouter, pack_routers
from executor_service.kernels.layer_kernels import load_layer_kernels
from executor_service.kernels.panel_linear import PanelKernel, load_panel_kernel
from tests.helpers.c_kernels import load_or_skip
from tests.helpers.model_factory import build_model

pytestmark = pytest.mark.skipif(
    not packing_available(torch.device("cpu"), torch.float32), reason="no oneDNN in this torch"
)

# gpt_oss: biases, transposed interleaved gate-and-up, clamped SwiGLU, softmax over the top-k;
# deepseek_v3: shared experts, grouped sigmoid routing; qwen3_moe and olmoe: top-k of a softmax;
# mixtral: the same, always renormalized; qwen2_moe: a shared expert behind a sigmoid gate.
MOE_ARCHITECTURES = ("gpt_oss", "deepseek_v3", "qwen3_moe", "mixtral", "qwen2_moe", "olmoe")
# Sparse blocks per model: deepseek_v3's first layer is dense, the others' two layers are sparse.
MOE_BLOCKS = {"gpt_oss": 2, "deepseek_v3": 1, "qwen3_moe": 2, "mixtral": 2, "qwen2_moe": 2, "olmoe": 2}


def backend(name: str) -> PanelKernel | None:
    """The panel kernel for "panels", None (oneDNN) for "onednn"."""
    if name == "onednn":
        return None
    return load_or_skip(load_panel_kernel, cpu_flag="avx512f")


def packed_model(model_dir: Path, panels: PanelKernel | None) -> PreTrainedModel:
    """The model as the executor packs it: the kernels' activations, routers, experts, then every
    linear layer."""
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    install_kernel_activations(model, load_or_skip(load_layer_kernels))
    pack_routers(model, panels)
    pack_experts(model, panels)
    pack_linears(model, panels)
    return model


def moe_blocks(model: nn.Module) -> list[nn.Module]:
    """The sparse blocks: a router (named gate or router) beside the experts."""
    return [
        module
        for module in model.modules()
        if any(isinstance(getattr(module, name, None), PackedRouter) for name in ("gate", "router"))
    ]


@pytest.mark.parametrize("backend_name", ["panels", "onednn"])
@pytest.mark.parametrize("arch", MOE_ARCHITECTURES)
def test_a_packed_moe_model_gives_the_plain_models_logits_and_tokens(arch: str, backend_name: str, tmp_path: Path) -> None:
    model_dir = build_model(arch, tmp_path / arch)
    plain = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    panels = backend(backend_name)
    packed = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    assert pack_routers(packed, panels) == MOE_BLOCKS[arch]
    assert pack_experts(packed, panels) == MOE_BLOCKS[arch]
    pack_linears(packed, panels)
    assert packed.config._experts_implementation == EXPERTS_NAME
    # The 3D expert weights are gone: only the packed copies hold them.
    assert not any(parameter.dim() == 3 for parameter in packed.parameters())
    prompt = torch.randint(3, 1000, (3, 37), generator=torch.Generator().manual_seed(0))
    with torch.inference_mode():
        torch.testing.assert_close(packed(prompt).logits, plain(prompt).logits, rtol=1e-4, atol=1e-4)
        greedy = {"max_new_tokens": 12, "do_sample": False, "pad_token_id": 0}
        assert torch.equal(packed.generate(prompt, **greedy), plain.generate(prompt, **greedy))


@pytest.mark.parametrize("threads", [1, 3])
@pytest.mark.parametrize("backend_name", ["panels", "onednn"])
@pytest.mark.parametrize("arch", MOE_ARCHITECTURES)
def test_a_tokens_moe_output_has_the_same_bits_alone_or_beside_others(
    arch: str, backend_name: str, threads: int, tmp_path: Path
) -> None:
    model = packed_model(build_model(arch, tmp_path / arch), backend(backend_name))
    blocks = moe_blocks(model)
    assert len(blocks) == MOE_BLOCKS[arch]
    hidden = torch.randn(1, 40, model.config.hidden_size, generator=torch.Generator().manual_seed(1))

    def output(block: nn.Module, rows: torch.Tensor) -> torch.Tensor:
        out = block(rows)
        # gpt_oss's block also returns its router scores.
        return out[0] if isinstance(out, tuple) else out

    before = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        with torch.inference_mode():
            for block in blocks:
                together = output(block, hidden)
                # Every row alone: torch's elementwise loops gave about one element in 25 other
                # bits alone than inside a longer vectorised run.
                for first, count in (*((row, 1) for row in range(40)), (3, 2), (10, 3), (20, 17)):
                    alone = output(block, hidden[:, first : first + count])
                    assert torch.equal(alone, together[:, first : first + count]), f"rows {first}..{first + count - 1}"
    finally:
        torch.set_num_threads(before)


def test_experts_that_cannot_all_be_packed_keep_transformers_computation(tmp_path: Path) -> None:
    model = AutoModelForCausalLM.from_pretrained(build_model("qwen3_moe", tmp_path / "m"), dtype=torch.bfloat16)
    chosen = model.config._experts_implementation
    assert pack_experts(model) == 0
    assert model.config._experts_implementation == chosen
    assert all(parameter.device.type == "cpu" for parameter in model.parameters())
