"""The workload floor counts the arithmetic the models really hold, and reads decode attention
at whichever of its flops and its K/V traffic takes longer."""

from __future__ import annotations

import torch
from transformers import LlamaConfig, LlamaForCausalLM

from bench.compare_models import RANDOM_LLAMA
from bench.workload_floor import Dims, four_bit_linear, model_dims, workload_floor
from executor_service.cpu_forward.packed_linear import PackedLinear
from executor_service.kernels.panel_linear import load_panel_kernel
from tests.helpers.c_kernels import load_or_skip


def test_a_tokens_linear_flops_are_twice_the_models_linear_weights() -> None:
    dims = model_dims(RANDOM_LLAMA)
    config = LlamaConfig(
        hidden_size=dims.hidden,
        num_hidden_layers=dims.layers,
        num_attention_heads=dims.heads,
        num_key_value_heads=dims.kv_heads,
        intermediate_size=dims.intermediate,
        vocab_size=dims.vocab,
    )
    with torch.device("meta"):
        model = LlamaForCausalLM(config)
    linear = [m.weight.numel() for m in model.modules() if isinstance(m, torch.nn.Linear)]
    head = model.lm_head.weight.numel()
    assert dims.body_flops == 2 * (sum(linear) - head)
    assert dims.head_flops == 2 * head


def test_a_small_workload_counted_by_hand() -> None:
    dims = Dims(hidden=4, layers=1, heads=2, kv_heads=1, head_dim=2, intermediate=8, vocab=10)
    # body: 2 * (4 * 2 * (2 * 2 + 2 * 1) + 3 * 4 * 8) = 288; head: 2 * 4 * 10 = 80
    floor = workload_floor(dims, prompts=[3], new_tokens=[2])
    # three prompt tokens, the first token's head, then one decode token over 4 keys
    assert floor.gemm_flops == 3 * 288 + 80 + (288 + 80)
    assert floor.prefill_attention_flops == 4 * 2 * 2 * (1 + 2 + 3)
    assert floor.decode_attention_flops == 4 * 2 * 2 * 4
    assert floor.decode_kv_bytes == 2 * 1 * 2 * 4 * 4
    compute_bound = floor.seconds(peak_flops=1.0, bandwidth=1e9)
    assert compute_bound == floor.gemm_flops + floor.prefill_attention_flops + floor.decode_attention_flops
    memory_bound = floor.seconds(peak_flops=1e9, bandwidth=1.0)
    assert memory_bound == floor.decode_kv_bytes + (floor.gemm_flops + floor.prefill_attention_flops) / 1e9


def test_the_four_bit_rate_is_measured_on_weights_the_panel_kernel_keeps_as_blocks() -> None:
    """Else the floor's fastest GEMM would quietly be the float path's again."""
    panels = load_or_skip(load_panel_kernel, cpu_flag="avx512f")
    assert PackedLinear(four_bit_linear(512, 96), panels).blocks is not None
