"""The panel kernel's float path (AMX off; test_panel_amx_floats.py has the tiles) computes
x W^T + b to float32 rounding for every shape (ragged panels and tiles, row blocks, empty
inputs), gives each row the same bits whatever rows share its call and
however many threads run it, refuses inputs it cannot take, and is what an executor packs for.
Its two epilogues (a residual added in place; SiLU(gate) * up of a joined gate-and-up weight)
give the bits of the separate operations.
Models packed for it are checked against the plain models in test_packed_linear.py, and every
executor parity test runs on it where the CPU has AVX-512."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from executor_service.cpu_forward.packed_linear import PackedLinear
from executor_service.kernels.layer_kernels import load_layer_kernels
from executor_service.kernels.panel_linear import PanelKernel
from executor_service.serving.settings import ExecutorSettings
from executor_service.startup.startup import build_executor
from tests.helpers.c_kernels import load_or_skip, panels_without_amx
from tests.helpers.model_factory import build_model


@pytest.fixture(scope="module")
def panels() -> Iterator[PanelKernel]:
    yield from panels_without_amx()


def assert_within_rounding(got: torch.Tensor, x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None) -> None:
    """|got - exact| <= gamma_(K+1) (|x| |W|^T + |b|): a chain of K float32 multiply-adds and the
    bias, each rounded once (Higham's bound for a dot product in any order)."""
    k = x.shape[-1]
    unit = 2.0**-24
    gamma = (k + 1) * unit / (1 - (k + 1) * unit)
    exact = x.double() @ weight.double().t()
    magnitude = x.double().abs() @ weight.double().abs().t()
    if bias is not None:
        exact += bias.double()
        magnitude += bias.double().abs()
    assert bool(((got.double() - exact).abs() <= gamma * magnitude + 1e-300).all())


@settings(max_examples=150, deadline=None)
@given(
    rows=st.integers(0, 40),
    in_features=st.integers(1, 300),
    out_features=st.integers(1, 130),
    with_bias=st.booleans(),
    scale=st.sampled_from([1e-20, 1.0, 1e15]),
    seed=st.integers(0, 2**31),
)
def test_every_shape_gives_the_product_to_float32_rounding(
    panels: PanelKernel, rows: int, in_features: int, out_features: int, with_bias: bool, scale: float, seed: int
) -> None:
    generator = torch.Generator().manual_seed(seed)
    weight = torch.randn(out_features, in_features, generator=generator) * scale
    bias = torch.randn(out_features, generator=generator) if with_bias else None
    x = torch.randn(rows, in_features, generator=generator)
    got = panels.linear(x, panels.pack(weight), out_features, bias)
    assert got.shape == (rows, out_features) and got.dtype == torch.float32
    assert_within_rounding(got, x, weight, bias)


@settings(max_examples=40, deadline=None)
@given(rows=st.integers(1, 70), in_features=st.sampled_from([7, 64, 576, 4096]), seed=st.integers(0, 2**31))
def test_a_rows_bits_do_not_depend_on_the_rows_beside_it_or_the_thread_count(
    panels: PanelKernel, rows: int, in_features: int, seed: int
) -> None:
    # 4096 inputs make row blocks of 16 rows, so larger calls span several blocks.
    generator = torch.Generator().manual_seed(seed)
    weight = torch.randn(100, in_features, generator=generator)
    x = torch.randn(rows, in_features, generator=generator)
    packed = panels.pack(weight)
    together = panels.linear(x, packed, 100, None)
    threads = torch.get_num_threads()
    try:
        torch.set_num_threads(1)
        alone = torch.cat([panels.linear(x[i : i + 1], packed, 100, None) for i in range(rows)])
    finally:
        torch.set_num_threads(threads)
    assert torch.equal(together, alone)
    assert_within_rounding(together, x, weight, None)


def fma_chain(x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    """x W^T as one chain of float32 fused multiply-adds per output, k = 0, 1, ..., K-1: each step
    is the float64 sum of the float32 accumulator and an exact float64 product, rounded to
    float32 (rounding through float64 first differs from one rounding only ~2^-29 of the time)."""
    acc = torch.zeros(x.shape[0], weight.shape[0], dtype=torch.float32)
    for kk in range(x.shape[1]):
        acc = (acc.double() + x[:, kk, None].double() * weight[None, :, kk].double()).float()
    return acc


@pytest.mark.parametrize(
    ("rows", "in_features", "out_features", "seed"), [(5, 300, 40, 0), (32, 577, 50, 1), (9, 1536, 33, 2)]
)
def test_every_output_is_one_multiply_add_chain_over_k_in_order(
    panels: PanelKernel, rows: int, in_features: int, out_features: int, seed: int
) -> None:
    # K is taken in blocks of ~128 (576 -> 5 blocks, 1,536 -> 12); a block's partial sums added
    # to the next's, rather than carried into its chain, would differ here in the last bits.
    generator = torch.Generator().manual_seed(seed)
    weight = torch.randn(out_features, in_features, generator=generator)
    x = torch.randn(rows, in_features, generator=generator)
    assert torch.equal(panels.linear(x, panels.pack(weight), out_features, None), fma_chain(x, weight))


def test_row_blocks_and_leading_dimensions_and_strided_inputs(panels: PanelKernel) -> None:
    generator = torch.Generator().manual_seed(3)
    weight, bias = torch.randn(200, 4096, generator=generator), torch.randn(200, generator=generator)
    x = torch.randn(2, 45, 8192, generator=generator)[..., ::2]
    got = panels.linear(x, panels.pack(weight), 200, bias)
    assert got.shape == (2, 45, 200)
    assert_within_rounding(got.reshape(90, 200), x.reshape(90, 4096), weight, bias)


@settings(max_examples=60, deadline=None)
@given(
    rows=st.integers(0, 40),
    in_features=st.integers(1, 200),
    panels_wide=st.integers(1, 7),
    with_bias=st.booleans(),
    scale=st.sampled_from([0.05, 1.0, 30.0]),
    seed=st.integers(0, 2**31),
)
def test_the_gated_epilogue_gives_the_bits_of_the_product_then_silu_mul(
    panels: PanelKernel, rows: int, in_features: int, panels_wide: int, with_bias: bool, scale: float, seed: int
) -> None:
    # scale 30 puts gates far past expf's overflow (|gate| ~ 30 sqrt(K)), where SiLU is 0 or gate.
    generator = torch.Generator().manual_seed(seed)
    width = panels_wide * panels.panel
    weight = torch.randn(2 * width, in_features, generator=generator) * scale
    bias = torch.randn(2 * width, generator=generator) if with_bias else None
    x = torch.randn(rows, in_features, generator=generator)
    packed = panels.pack(weight)
    got = panels.linear_silu_mul(x, packed, width, bias)
    expected = load_or_skip(load_layer_kernels).silu_mul(panels.linear(x, packed, 2 * width, bias))
    assert got.shape == (rows, width) and not got.isnan().any()
    assert torch.equal(got, expected)


@settings(max_examples=40, deadline=None)
@given(
    rows=st.integers(0, 40),
    in_features=st.integers(1, 200),
    out_features=st.integers(1, 70),
    seed=st.integers(0, 2**31),
)
def test_the_residual_epilogue_adds_into_the_residual_in_place(
    panels: PanelKernel, rows: int, in_features: int, out_features: int, seed: int
) -> None:
    generator = torch.Generator().manual_seed(seed)
    weight = torch.randn(out_features, in_features, generator=generator)
    bias = torch.randn(out_features, generator=generator)
    x = torch.randn(rows, in_features, generator=generator)
    residual = torch.randn(rows, out_features, generator=generator)
    packed = panels.pack(weight)
    expected = residual + panels.linear(x, packed, out_features, bias)
    got = panels.linear(x, packed, out_features, bias, residual)
    assert got.data_ptr() == residual.data_ptr() and torch.equal(residual, expected)


def test_silu_mul_past_the_exponentials_range_is_torchs(panels: PanelKernel) -> None:
    # An approximate vector expf (glibc's, under -ffast-math) once turned overflow into NaN: silu(-100) * up.
    gates = torch.tensor([-1e30, -200.0, -100.0, -88.8, -88.7, -88.0, 0.0, 3.0, 88.8, 1e30] + [1.5] * 6)
    gate_up = torch.cat([gates, torch.linspace(-2.0, 2.0, 16)])[None]
    got = load_or_skip(load_layer_kernels).silu_mul(gate_up)
    torch.testing.assert_close(got, torch.nn.functional.silu(gate_up[:, :16]) * gate_up[:, 16:], rtol=1e-6, atol=0.0)


def test_inputs_it_cannot_take_are_refused_with_the_reason(panels: PanelKernel) -> None:
    packed = panels.pack(torch.randn(32, 16))
    with pytest.raises(ValueError, match="do not fit the packed weight"):
        panels.linear(torch.randn(4, 17), packed, 32, None)
    with pytest.raises(ValueError, match="float32 CPU tensors"):
        panels.linear(torch.randn(4, 16, dtype=torch.float64), packed, 32, None)
    with pytest.raises(ValueError, match="bias"):
        panels.linear(torch.randn(4, 16), packed, 32, torch.randn(31))
    with pytest.raises(ValueError, match="residual"):
        panels.linear(torch.randn(4, 16), packed, 32, None, torch.randn(4, 31))
    with pytest.raises(ValueError, match="residual"):
        panels.linear(torch.randn(4, 16), packed, 32, None, torch.randn(32, 4).t())
    with pytest.raises(ValueError, match="whole panels"):
        panels.linear_silu_mul(torch.randn(4, 16), packed, 8, None)


def test_an_executor_packs_for_panels_unless_told_not_to(panels: PanelKernel, tmp_path: Path) -> None:
    model_dir = build_model("llama", tmp_path / "llama")
    for panel_linear, backend in ((True, "panels"), (False, "onednn")):
        settings_ = ExecutorSettings(
            model_dir=model_dir, device="cpu", num_kv_blocks=8, block_size=8, panel_linear=panel_linear
        )
        model = build_executor(settings_).runner.loaded.model
        packed = [m for m in model.modules() if isinstance(m, PackedLinear)]
        assert packed and {m.extra_repr().rsplit("=", 1)[1] for m in packed} == {backend}
