"""4-bit affine blocks (panel_linear.py): a weight whose every 32 consecutive inputs of an output
take values d q + m (q in 0..15), as a model dequantized from GGUF's Q4_1 holds, is kept a second
time as those blocks, and calls of up to 64 rows read them (AMX off; on, every call multiplies
the blocks on its tiles: test_panel_amx.py). What must hold: every product has
the bits of the plain float32 weight's (the blocks rebuild the same floats), for every shape,
epilogue and row count on either side of the 64-row switch; a weight with a single value off its
block's grid is refused, as is one whose inputs are not whole blocks; blocks of another weight
are refused at the call."""

from __future__ import annotations

from collections.abc import Iterator

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from torch import nn

from executor_service.cpu_forward.packed_linear import PackedLinear
from executor_service.kernels.panel_linear import PanelKernel
from tests.helpers.c_kernels import panels_without_amx

BLOCK = 32


@pytest.fixture(scope="module")
def panels() -> Iterator[PanelKernel]:
    yield from panels_without_amx()


def four_bit_weight(out_features: int, in_features: int, generator: torch.Generator) -> torch.Tensor:
    """Values fma(d, q, m) per block as GGUF's Q4_1 dequantizes them: d a half-precision step,
    m the block's least value (q = 0), q up to 15 (reached in every block, as the quantizer
    makes it)."""
    blocks = in_features // BLOCK
    step = (torch.rand(out_features, blocks, 1, generator=generator) * 0.01 + 1e-4).half().float()
    low = torch.randn(out_features, blocks, 1, generator=generator) * 0.1
    levels = torch.randint(0, 16, (out_features, blocks, BLOCK), generator=generator).float()
    levels[..., 0], levels[..., 1] = 0.0, 15.0
    # d * q is exact in float32 (an 11-bit step times a 4-bit level), so one rounding: fma's.
    return (step * levels + low).reshape(out_features, in_features)


# Width of each half of the joined [gate; up] weights the gated cases multiply by.
GATED_WIDTH = 48


def gated_case(
    panels: PanelKernel, rows: int, blocks: int, seed: int
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Generator]:
    """x [rows, blocks * 32], a joined [gate; up] weight of 4-bit blocks packed both ways
    (GATED_WIDTH outputs a half), its bias, and the generator, seeded, for more operands."""
    generator = torch.Generator().manual_seed(seed)
    in_features = blocks * BLOCK
    weight = four_bit_weight(2 * GATED_WIDTH, in_features, generator)
    packed, four_bit = panels.pack(weight), panels.pack_blocks(weight)
    assert four_bit is not None
    x = torch.randn(rows, in_features, generator=generator)
    bias = torch.randn(2 * GATED_WIDTH, generator=generator)
    return x, packed, four_bit, bias, generator


@settings(max_examples=40, deadline=None)
@given(
    rows=st.sampled_from([1, 3, 8, 31, 32, 64, 65, 130]),
    blocks=st.integers(1, 20),
    out_features=st.integers(1, 70),
    with_bias=st.booleans(),
    seed=st.integers(0, 2**31),
)
def test_products_from_the_blocks_have_the_float_weights_bits(
    panels: PanelKernel, rows: int, blocks: int, out_features: int, with_bias: bool, seed: int
) -> None:
    generator = torch.Generator().manual_seed(seed)
    in_features = blocks * BLOCK
    weight = four_bit_weight(out_features, in_features, generator)
    packed, four_bit = panels.pack(weight), panels.pack_blocks(weight)
    assert four_bit is not None
    x = torch.randn(rows, in_features, generator=generator)
    bias = torch.randn(out_features, generator=generator) if with_bias else None
    plain = panels.linear(x, packed, out_features, bias)
    assert torch.equal(panels.linear(x, packed, out_features, bias, blocks=four_bit), plain)
    residual = torch.randn(rows, out_features, generator=generator)
    expected = panels.linear(x, packed, out_features, bias, residual.clone())
    assert torch.equal(panels.linear(x, packed, out_features, bias, residual, four_bit), expected)


@settings(max_examples=25, deadline=None)
@given(rows=st.sampled_from([1, 5, 32, 64, 65]), blocks=st.integers(1, 40), seed=st.integers(0, 2**31))
def test_the_gated_epilogue_from_the_blocks_has_the_float_weights_bits(
    panels: PanelKernel, rows: int, blocks: int, seed: int
) -> None:
    x, packed, four_bit, bias, _ = gated_case(panels, rows, blocks, seed)
    expected = panels.linear_silu_mul(x, packed, GATED_WIDTH, bias)
    assert torch.equal(panels.linear_silu_mul(x, packed, GATED_WIDTH, bias, four_bit), expected)


def test_weights_not_made_of_blocks_are_refused(panels: PanelKernel) -> None:
    generator = torch.Generator().manual_seed(0)
    assert panels.pack_blocks(torch.randn(40, 64, generator=generator)) is None
    weight = four_bit_weight(40, 64, generator)
    assert panels.pack_blocks(weight) is not None
    # One value a unit in the last place off its block's grid.
    nudged = weight.clone()
    nudged[37, 45] = torch.nextafter(nudged[37, 45], torch.tensor(torch.inf))
    assert panels.pack_blocks(nudged) is None
    # Inputs that are not whole blocks.
    assert panels.pack_blocks(four_bit_weight(40, 96, generator)[:, :80]) is None


def test_blocks_of_another_weight_are_refused(panels: PanelKernel) -> None:
    generator = torch.Generator().manual_seed(1)
    weight = four_bit_weight(32, 64, generator)
    packed = panels.pack(weight)
    other = panels.pack_blocks(four_bit_weight(48, 64, generator))
    with pytest.raises(ValueError, match="4-bit blocks do not fit"):
        panels.linear(torch.randn(4, 64), packed, 32, None, blocks=other)
    with pytest.raises(ValueError, match="4-bit blocks do not fit"):
        panels.linear_silu_mul(torch.randn(4, 64), packed, 16, None, other)


def test_a_packed_linear_keeps_blocks_only_for_a_weight_made_of_them(panels: PanelKernel) -> None:
    generator = torch.Generator().manual_seed(2)
    made_of_blocks, plain = nn.Linear(64, 40), nn.Linear(64, 40)
    with torch.no_grad():
        made_of_blocks.weight.copy_(four_bit_weight(40, 64, generator))
    with_blocks, without = PackedLinear(made_of_blocks, panels), PackedLinear(plain, panels)
    assert with_blocks.blocks is not None and without.blocks is None
    assert "4-bit blocks" in with_blocks.extra_repr() and "4-bit" not in without.extra_repr()
    x = torch.randn(6, 64, generator=generator)
    with torch.no_grad():
        assert torch.equal(with_blocks(x), panels.linear(x, with_blocks.packed, 40, made_of_blocks.bias))
