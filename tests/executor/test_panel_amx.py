"""The panel kernel on AMX's bf16 tiles (kernels/panel_amx.c), for weights kept as 4-bit blocks:
the product to float32 accuracy (not the float path's bits, but no further from exact), each
row's bits whatever rows share its call and however many threads run it, the epilogues the bits
of the separate operations, and switching it off gives the float path back. Skipped only on CPUs
without AMX; a CPU with it whose kernel does not turn it on fails."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from executor_service.__main__ import parse_args
from executor_service.kernels.layer_kernels import load_layer_kernels
from executor_service.kernels.panel_linear import PanelKernel
from executor_service.serving.settings import ExecutorSettings
from executor_service.startup.startup import build_executor
from tests.executor.test_panel_blocks import (
    BLOCK,
    GATED_WIDTH,
    four_bit_weight,
    gated_case,
)
from tests.helpers.c_kernels import amx_off, load_or_skip, panels_with_amx
from tests.helpers.model_factory import build_model

# The bound tests' cases: row counts either side of a tile (16), of the two a pass takes (32) and
# of the most that split every row in every thread (64); K of 1-50 blocks of 32; ragged panels.
BOUND_CASES = given(
    rows=st.sampled_from([1, 2, 15, 16, 17, 31, 32, 33, 64, 65, 100, 300]),
    blocks=st.integers(1, 50),
    out_features=st.integers(1, 70),
    with_bias=st.booleans(),
    seed=st.integers(0, 2**31),
)


@pytest.fixture(scope="module")
def panels() -> Iterator[PanelKernel]:
    yield from panels_with_amx()


def block_magnitude(weight: torch.Tensor) -> torch.Tensor:
    """|d q| + |m| per value: what the tiles and the block sums each multiply x by (a value d q + m
    can be small where the two nearly cancel, so |W| alone would understate the rounding)."""
    blocks = weight.double().reshape(weight.shape[0], -1, BLOCK)
    low = blocks.amin(-1, keepdim=True)
    return ((blocks - low) + low.abs()).reshape(weight.shape)


def exact_and_error(
    got: torch.Tensor, x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None
) -> tuple[torch.Tensor, torch.Tensor]:
    exact = x.double() @ weight.double().t() + (0.0 if bias is None else bias.double())
    return exact, (got.double() - exact).abs()


@settings(max_examples=60, deadline=None)
@BOUND_CASES
def test_products_are_within_float32_rounding_of_exact(
    panels: PanelKernel, rows: int, blocks: int, out_features: int, with_bias: bool, seed: int
) -> None:
    """Every output within gamma_n (|x| (|d q| + |m|) + |b|), n the roundings one output's sum
    goes through: three pieces times K in the tiles, then two per block and the bias."""
    generator = torch.Generator().manual_seed(seed)
    in_features = blocks * BLOCK
    weight = four_bit_weight(out_features, in_features, generator)
    packed, four_bit = panels.pack(weight), panels.pack_blocks(weight)
    x = torch.randn(rows, in_features, generator=generator)
    bias = torch.randn(out_features, generator=generator) if with_bias else None
    got = panels.linear(x, packed, out_features, bias, blocks=four_bit)
    _, error = exact_and_error(got, x, weight, bias)
    n = 3 * in_features + 2 * blocks + 1
    gamma = n * 2.0**-24 / (1 - n * 2.0**-24)
    magnitude = x.double().abs() @ block_magnitude(weight).t() + (0.0 if bias is None else bias.double().abs())
    assert bool((error <= gamma * magnitude).all())


@pytest.mark.parametrize(("rows", "in_features", "out_features"), [(32, 576, 960), (300, 1536, 576), (7, 96, 40)])
def test_products_are_no_further_from_exact_than_the_float_paths(
    panels: PanelKernel, rows: int, in_features: int, out_features: int
) -> None:
    """The three bf16 pieces carry all of x's bits: a piece lost (the float path's error times
    2^8 or more) fails this, as would any error past the float path's own."""
    generator = torch.Generator().manual_seed(rows)
    weight = four_bit_weight(out_features, in_features, generator)
    packed, four_bit = panels.pack(weight), panels.pack_blocks(weight)
    x = torch.randn(rows, in_features, generator=generator)
    on_tiles = panels.linear(x, packed, out_features, None, blocks=four_bit)
    with amx_off(panels):
        as_floats = panels.linear(x, packed, out_features, None, blocks=four_bit)
        assert torch.equal(as_floats, panels.linear(x, packed, out_features, None))
    _, tile_error = exact_and_error(on_tiles, x, weight, None)
    _, float_error = exact_and_error(as_floats, x, weight, None)
    assert tile_error.square().mean().sqrt() <= float_error.square().mean().sqrt()
    assert not torch.equal(on_tiles, as_floats)


def test_a_rows_bits_do_not_depend_on_the_rows_beside_it_or_the_thread_count(panels: PanelKernel) -> None:
    generator = torch.Generator().manual_seed(3)
    weight = four_bit_weight(70, 640, generator)
    packed, four_bit = panels.pack(weight), panels.pack_blocks(weight)
    x = torch.randn(300, 640, generator=generator)
    together = panels.linear(x, packed, 70, None, blocks=four_bit)
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        alone = torch.cat([panels.linear(x[r : r + 1], packed, 70, None, blocks=four_bit) for r in range(0, 300, 37)])
        one_thread = panels.linear(x, packed, 70, None, blocks=four_bit)
    finally:
        torch.set_num_threads(threads)
    assert torch.equal(alone, together[::37])
    assert torch.equal(one_thread, together)
    for rows in (16, 33, 64, 65, 130):
        assert torch.equal(panels.linear(x[:rows], packed, 70, None, blocks=four_bit), together[:rows])


@settings(max_examples=25, deadline=None)
@given(rows=st.sampled_from([1, 5, 32, 64, 65, 200]), blocks=st.integers(1, 40), seed=st.integers(0, 2**31))
def test_the_epilogues_give_the_bits_of_the_separate_operations(
    panels: PanelKernel, rows: int, blocks: int, seed: int
) -> None:
    x, packed, four_bit, bias, generator = gated_case(panels, rows, blocks, seed)
    product = panels.linear(x, packed, 2 * GATED_WIDTH, bias, blocks=four_bit)
    gated = panels.linear_silu_mul(x, packed, GATED_WIDTH, bias, four_bit)
    assert torch.equal(gated, load_or_skip(load_layer_kernels).silu_mul(product))
    residual = torch.randn(rows, 2 * GATED_WIDTH, generator=generator)
    expected = residual + product
    got = panels.linear(x, packed, 2 * GATED_WIDTH, bias, residual, four_bit)
    assert got.data_ptr() == residual.data_ptr() and torch.equal(residual, expected)


def test_amx_is_opt_in(panels: PanelKernel, tmp_path: Path) -> None:
    """By default (and with --no-amx) the float path, its bits the same on every AVX-512 CPU;
    --amx (ExecutorSettings.amx) turns AMX on where the CPU has it."""
    model_dir = build_model("llama", tmp_path / "llama")
    open_model = ["--model", str(model_dir), "--port", "0", "--insecure-executor"]
    assert not parse_args(open_model).amx
    assert not parse_args([*open_model, "--no-amx"]).amx
    assert parse_args([*open_model, "--amx"]).amx
    try:
        build_executor(ExecutorSettings(model_dir=model_dir, device="cpu", num_kv_blocks=8))
        assert not panels.amx
        build_executor(ExecutorSettings(model_dir=model_dir, device="cpu", num_kv_blocks=8, amx=True))
        assert panels.amx
    finally:
        panels.use_amx(True)
