"""Activations of layers that are not fused (executor_service/cpu_forward/kernel_activations.py):
each element's bits depend on its value alone, and a sequence's logprobs on an architecture with
such layers are the same alone and batched when the intermediate width is not a multiple of the
vector width and several threads share the step, where torch's activations gave the last rows of
a step other bits than a row alone."""

from __future__ import annotations

import math
import random
from collections.abc import Iterator
from pathlib import Path

import grpc
import pytest
import torch
from transformers.activations import ACT2FN

from executor_service.cpu_forward.kernel_activations import Activation, activation_of
from executor_service.kernels.layer_kernels import LayerKernels, load_layer_kernels
from protos.splitserve.executor.v1 import executor_pb2 as pb
from tests.helpers.c_kernels import load_or_skip
from tests.helpers.executor_driver import (
    BlockAllocator,
    Driver,
    PlannedRequest,
    PlanStream,
)
from tests.helpers.executor_process import ExecutorProcess
from tests.helpers.executor_token import with_token
from tests.helpers.model_factory import build_model

TORCH_NAMES = {
    Activation.SILU: "silu",
    Activation.SIGMOID: "sigmoid",
    Activation.GELU_TANH: "gelu_pytorch_tanh",
    Activation.GELU_ERF: "gelu",
    Activation.QUICK_GELU: "quick_gelu",
}
# Each in float64, written to keep its relative accuracy where the result is small.
EXACT = {
    Activation.SILU: lambda x: x * torch.sigmoid(x),
    Activation.SIGMOID: torch.sigmoid,
    Activation.GELU_TANH: lambda x: x * torch.sigmoid(2 * math.sqrt(2 / math.pi) * (x + 0.044715 * x**3)),
    Activation.GELU_ERF: lambda x: 0.5 * x * torch.special.erfc(-x / math.sqrt(2)),
    Activation.QUICK_GELU: lambda x: x * torch.sigmoid(1.702 * x),
}
BLOCK_SIZE = 16
NUM_BLOCKS = 256
# Not a multiple of 16: torch's loop leaves the last elements of a tensor to its scalar tail.
ODD_WIDTH = 100


@pytest.fixture(scope="module")
def kernels() -> LayerKernels:
    return load_or_skip(load_layer_kernels)


def _inputs() -> torch.Tensor:
    generator = torch.Generator().manual_seed(0)
    spread = torch.randn(20_000, generator=generator) * 4
    edges = torch.tensor([0.0, -0.0, 1e-30, -1e-30, 44.0, -44.0, 88.0, -88.0, 90.0, -90.0, 1e4, -1e4])
    return torch.cat([spread, torch.linspace(-40, 40, 4_001), edges])


@pytest.mark.parametrize("kind", list(Activation), ids=lambda kind: kind.name.lower())
def test_an_activation_agrees_with_torch_and_has_the_same_bits_wherever_an_element_lies(
    kernels: LayerKernels, kind: Activation
) -> None:
    x = _inputs()
    ours = kernels.activation(kind, x)
    assert torch.isfinite(ours).all()
    # Within a few ulp of the function itself (torch's GELUs lose their negative tails to
    # cancellation, ours keep them), and close to torch's in absolute terms.
    torch.testing.assert_close(ours.double(), EXACT[kind](x.double()), rtol=2e-5, atol=1e-37)
    torch.testing.assert_close(ours, ACT2FN[TORCH_NAMES[kind]](x), rtol=0, atol=1e-6)
    for offset in (1, 5, 13):
        assert torch.equal(kernels.activation(kind, x[offset:]), ours[offset:]), f"shifted by {offset}"
    alone = torch.cat([kernels.activation(kind, x[i : i + 1]) for i in range(0, x.numel(), 97)])
    assert torch.equal(alone, ours[::97])
    before = torch.get_num_threads()
    try:
        torch.set_num_threads(3)
        assert torch.equal(kernels.activation(kind, x), ours)
    finally:
        torch.set_num_threads(before)


def test_every_activation_module_a_parity_architecture_holds_is_one_the_kernels_compute() -> None:
    for name in ("silu", "swish", "sigmoid", "gelu", "gelu_new", "gelu_fast", "gelu_pytorch_tanh", "quick_gelu"):
        assert activation_of(ACT2FN[name]) is not None, name
    assert activation_of(torch.nn.GELU(approximate="tanh")) is Activation.GELU_TANH
    assert activation_of(torch.nn.ReLU()) is None


# The exact GELU in GPT-NeoX, the tanh GELU in Gemma 2, SiLU in Qwen2.
ODD_MODELS = {
    "gpt_neox": {"intermediate_size": ODD_WIDTH},
    "gemma2": {"intermediate_size": ODD_WIDTH},
    "qwen2": {"intermediate_size": ODD_WIDTH},
}
# With torch's SiLU, about one in 25 of the four elements a row alone leaves to the scalar tail
# took other bits: over this many steps of two layers a difference is all but certain.
NEW_TOKENS = 24


@pytest.fixture(scope="module", params=list(ODD_MODELS))
def driver(
    request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory, kernels: LayerKernels
) -> Iterator[Driver]:
    """An executor on a model whose MLP is `ODD_WIDTH` wide; without the C kernels (no compiler)
    the executor would keep torch's activations, so the test needs them like the executor does."""
    arch: str = request.param
    model_dir: Path = build_model(arch, tmp_path_factory.mktemp(arch), **ODD_MODELS[arch])
    executor = ExecutorProcess(model_dir, num_kv_blocks=NUM_BLOCKS, block_size=BLOCK_SIZE, threads=3)
    try:
        with grpc.insecure_channel(executor.wait_ready()) as channel:
            stream = PlanStream(with_token(channel))
            yield Driver(stream, BLOCK_SIZE, BlockAllocator(NUM_BLOCKS))
            stream.close()
    finally:
        executor.close()


def test_an_odd_intermediate_width_on_three_threads_keeps_a_sequences_bits_alone_and_batched(driver: Driver) -> None:
    rng = random.Random(3)
    prompt = [rng.randrange(3, 1024) for _ in range(37)]
    sampling = pb.SamplerConfig(want_logprobs=True, num_logprobs=5)
    alone = driver.run_logprobs([PlannedRequest("alone", prompt, NEW_TOKENS, sampling=sampling)])["alone"]
    others = [
        PlannedRequest(f"other{i}", [rng.randrange(3, 1024) for _ in range(rng.randrange(20, 120))], NEW_TOKENS)
        for i in range(7)
    ]
    # First in the step: its rows are never the step's last, which torch left to its tail.
    batched = driver.run_logprobs([PlannedRequest("batched", prompt, NEW_TOKENS, sampling=sampling), *others])["batched"]
    assert len(alone) == NEW_TOKENS
    assert batched == alone
