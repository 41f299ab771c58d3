"""The panel kernel on AMX's bf16 tiles (kernels/panel_amx.c) for float32 weights: each weight and
each x split into three exact bf16 pieces, the six largest of the nine products kept. Within
float32 rounding of exact (closer than the float path), each row's bits whatever rows share its
call and however many threads run it, the epilogues the bits of the separate operations, and a K
the tiles cannot take (not a whole number of 32s) left to the float path. Skipped only on CPUs
without AMX."""

from __future__ import annotations

from collections.abc import Iterator

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from executor_service.kernels.layer_kernels import load_layer_kernels
from executor_service.kernels.panel_linear import PanelKernel
from tests.executor.test_panel_amx import BOUND_CASES
from tests.helpers.c_kernels import amx_off, load_or_skip, panels_with_amx

# Inputs per tile block: K must be a whole number of them for the tiles.
BLOCK = 32
# Bound on the three products left out, relative to |x| |w|: x's and w's second pieces are under
# 2^-7 of them, their third under 2^-15.
DROPPED = 2.0**-21


@pytest.fixture(scope="module")
def panels() -> Iterator[PanelKernel]:
    yield from panels_with_amx()


def case(rows: int, in_features: int, out_features: int, seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    """x and a weight of the scale of a model's, where every bit of both matters."""
    generator = torch.Generator().manual_seed(seed)
    return torch.randn(rows, in_features, generator=generator), torch.randn(
        out_features, in_features, generator=generator
    ) * in_features**-0.5


def float_path(panels: PanelKernel, x: torch.Tensor, packed: torch.Tensor, out_features: int) -> torch.Tensor:
    with amx_off(panels):
        return panels.linear(x, packed, out_features, None)


def error(got: torch.Tensor, x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    return (got.double() - (x.double() @ weight.double().t() + (0.0 if bias is None else bias.double()))).abs()


@settings(max_examples=60, deadline=None)
@BOUND_CASES
def test_products_are_within_float32_rounding_of_exact(
    panels: PanelKernel, rows: int, blocks: int, out_features: int, with_bias: bool, seed: int
) -> None:
    """Every output within (gamma_n + 2^-21) (|x| |w| + |b|), n the roundings of one output's
    sum: six products a k in the tiles, and the bias."""
    x, weight = case(rows, blocks * BLOCK, out_features, seed)
    bias = torch.randn(out_features, generator=torch.Generator().manual_seed(seed)) if with_bias else None
    got = panels.linear(x, panels.pack(weight), out_features, bias)
    n = 6 * blocks * BLOCK + 1
    gamma = n * 2.0**-24 / (1 - n * 2.0**-24)
    magnitude = x.double().abs() @ weight.double().abs().t() + (0.0 if bias is None else bias.double().abs())
    assert bool((error(got, x, weight, bias) <= (gamma + DROPPED) * magnitude).all())


@pytest.mark.parametrize(
    ("rows", "in_features", "out_features"), [(1, 512, 1024), (32, 512, 1024), (300, 1408, 512), (7, 96, 40)]
)
def test_products_are_no_further_from_exact_than_the_float_paths(
    panels: PanelKernel, rows: int, in_features: int, out_features: int
) -> None:
    """A piece of x or of w lost puts the error 2^8 times past the float path's; so would any
    product of the first two pieces left out."""
    x, weight = case(rows, in_features, out_features, rows)
    packed = panels.pack(weight)
    on_tiles = panels.linear(x, packed, out_features, None)
    as_floats = float_path(panels, x, packed, out_features)
    rms = [error(got, x, weight, None).square().mean().sqrt() for got in (on_tiles, as_floats)]
    assert rms[0] <= rms[1]
    assert not torch.equal(on_tiles, as_floats)


def test_a_rows_bits_do_not_depend_on_the_rows_beside_it_or_the_thread_count(panels: PanelKernel) -> None:
    """Calls of up to two row tiles split the weights block by block, larger ones pair by pair,
    and calls of over 64 rows share out row blocks instead of pairs: all the same bits."""
    x, weight = case(700, 640, 70, 3)
    packed = panels.pack(weight)
    together = panels.linear(x, packed, 70, None)
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        alone = torch.cat([panels.linear(x[r : r + 1], packed, 70, None) for r in range(0, 700, 37)])
        one_thread = panels.linear(x, packed, 70, None)
    finally:
        torch.set_num_threads(threads)
    assert torch.equal(alone, together[::37])
    assert torch.equal(one_thread, together)
    for rows in (5, 16, 32, 33, 64, 65, 130, 300):
        assert torch.equal(panels.linear(x[:rows], packed, 70, None), together[:rows])


@settings(max_examples=25, deadline=None)
@given(rows=st.sampled_from([1, 5, 32, 64, 65, 200]), blocks=st.integers(1, 40), seed=st.integers(0, 2**31))
def test_the_epilogues_give_the_bits_of_the_separate_operations(
    panels: PanelKernel, rows: int, blocks: int, seed: int
) -> None:
    width = 48
    x, weight = case(rows, blocks * BLOCK, 2 * width, seed)
    bias = torch.randn(2 * width, generator=torch.Generator().manual_seed(seed))
    packed = panels.pack(weight)
    product = panels.linear(x, packed, 2 * width, bias)
    gated = panels.linear_silu_mul(x, packed, width, bias)
    assert torch.equal(gated, load_or_skip(load_layer_kernels).silu_mul(product))
    residual = torch.randn(rows, 2 * width)
    expected = residual + product
    got = panels.linear(x, packed, 2 * width, bias, residual)
    assert got.data_ptr() == residual.data_ptr() and torch.equal(residual, expected)


@pytest.mark.parametrize("in_features", [40, 100])
def test_a_k_the_tiles_cannot_take_keeps_the_float_paths_bits(panels: PanelKernel, in_features: int) -> None:
    x, weight = case(20, in_features, 33, in_features)
    packed = panels.pack(weight)
    assert torch.equal(panels.linear(x, packed, 33, None), float_path(panels, x, packed, 33))
