"""The C argmax that greedy rows take on CPU picks the token torch.argmax picks, for any logits:
ties, NaNs, infinities and signed zeros included, at one thread or several, strided or not; and
a CPU executor's steps sample with it."""

from __future__ import annotations

import math
from pathlib import Path

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from executor_service.kernels.argmax_kernel import RowArgmax, load_row_argmax
from executor_service.sampling.sampler import SamplingRow, sample
from executor_service.sampling.sampler_settings import SamplerSettings
from executor_service.serving.settings import ExecutorSettings
from executor_service.startup import startup
from protos.splitserve.executor.v1 import executor_pb2 as pb
from tests.helpers.c_kernels import load_or_skip
from tests.helpers.model_factory import build_model

# Few distinct values, so that ties and specials meet often.
# The largest finite float32 and the smallest denormal sit beside infinity and zero.
FLOAT32_MAX = 3.4028234663852886e38
SPECIALS = [math.nan, -math.nan, math.inf, -math.inf, 0.0, -0.0, 1.0, -1.0, FLOAT32_MAX, -FLOAT32_MAX, 1e-45, -1e-45]


@pytest.fixture(scope="module")
def argmax() -> RowArgmax:
    return load_or_skip(load_row_argmax)


# Rows where the order of specials decides the answer, which random draws seldom reach.
DECIDING_ROWS = [
    [-0.0, 0.0, -1.0],
    [0.0, -0.0, -1.0],
    [-1e-45, -0.0, 0.0],
    [-math.inf, -math.inf, -math.inf],
    [1.0, math.nan, math.nan],
    [-math.nan, math.inf, math.nan],
    [FLOAT32_MAX, math.inf, FLOAT32_MAX],
    [-FLOAT32_MAX, -math.inf, -FLOAT32_MAX],
    [1e-45, 0.0, 1e-45],
]


@pytest.mark.parametrize("row", DECIDING_ROWS)
def test_ties_nans_infinities_and_signed_zeros(argmax: RowArgmax, row: list[float]) -> None:
    # Each row also long enough for the chunked scan: the deciding values come last.
    for logits in (torch.tensor([row]), torch.tensor([[-5.0] * 130 + row])):
        assert argmax(logits).tolist() == logits.argmax(dim=-1).tolist()


def test_every_nan_payload_counts_as_nan(argmax: RowArgmax) -> None:
    # Signalling NaNs and the smallest payloads of either sign, which Python floats cannot carry.
    bits = [0x3F800000, 0x7F800001, 0xFF800001, 0x7FBFFFFF, 0x7F800000]
    for order in (bits, bits[::-1]):
        logits = torch.tensor([order], dtype=torch.int64).to(torch.int32).view(torch.float32)
        assert argmax(logits).tolist() == logits.argmax(dim=-1).tolist()


@st.composite
def logit_rows(draw: st.DrawFn) -> list[list[float]]:
    """1-4 rows of one length, up to 200: past the kernel's first 64-element chunks."""
    cols = draw(st.integers(1, 200))
    value = st.sampled_from(SPECIALS) | st.floats(width=32)
    return draw(st.lists(st.lists(value, min_size=cols, max_size=cols), min_size=1, max_size=4))


@settings(max_examples=100, deadline=None)
@given(rows=logit_rows(), threads=st.sampled_from([1, 2, 3]))
def test_the_c_argmax_picks_what_torch_picks(argmax: RowArgmax, rows: list[list[float]], threads: int) -> None:
    logits = torch.tensor(rows, dtype=torch.float32)
    previous = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        assert argmax(logits).tolist() == logits.argmax(dim=-1).tolist()
    finally:
        torch.set_num_threads(previous)


def test_vocabulary_sized_rows_strided_or_not(argmax: RowArgmax) -> None:
    generator = torch.Generator().manual_seed(3)
    logits = torch.randn(33, 32_001, generator=generator)
    # A maximum repeated late in a row, past the first chunks the kernel scans whole.
    logits[5, 30_000] = logits[5, 31_999] = 50.0
    logits[7, -1] = math.nan
    assert argmax(logits).tolist() == logits.argmax(dim=-1).tolist()
    every_other_row = logits[1::2]
    assert argmax(every_other_row).tolist() == every_other_row.argmax(dim=-1).tolist()
    columns = logits[:, 1::3]
    assert argmax(columns).tolist() == columns.argmax(dim=-1).tolist()


def test_what_it_cannot_take_is_refused(argmax: RowArgmax) -> None:
    with pytest.raises(ValueError, match="float32"):
        argmax(torch.zeros(2, 5, dtype=torch.float64))
    with pytest.raises(ValueError, match="empty"):
        argmax(torch.zeros(2, 0))


def test_the_sampler_takes_greedy_tokens_from_the_argmax_it_is_given() -> None:
    logits = torch.randn(3, 1_000, generator=torch.Generator().manual_seed(0))
    greedy = SamplingRow(SamplerSettings(temperature=0.0), None, [1], [])
    # A draw from the top one token only: the row's argmax, through the sampler's own path.
    drawn = SamplingRow(SamplerSettings(temperature=1.0, top_k=1), None, [1], [])
    always_seven = lambda rows: torch.full((rows.shape[0],), 7)  # noqa: E731
    tokens = sample(logits, [greedy, drawn, greedy], torch.Generator().manual_seed(1), always_seven).token_ids
    assert tokens == [7, int(logits[1].argmax()), 7]


def test_a_cpu_executor_samples_greedy_rows_with_it(
    argmax: RowArgmax, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    calls: list[tuple[int, ...]] = []

    def counted(logits: torch.Tensor) -> torch.Tensor:
        calls.append(tuple(logits.shape))
        return argmax(logits)

    monkeypatch.setattr(startup, "load_row_argmax", lambda: counted)
    settings = ExecutorSettings(model_dir=build_model("llama", tmp_path), device="cpu", num_kv_blocks=8, block_size=8)
    runner = startup.build_executor(settings).runner
    assert calls == []  # the start-up checks sample without it
    plan = pb.StepPlan(
        step_id=1,
        new_requests=[
            pb.NewRequest(request_id=name, token_ids=[5, 6, 7], block_ids=[block], num_scheduled_tokens=3)
            for name, block in (("a", 0), ("b", 1))
        ],
    )
    outputs = runner.execute(plan).outputs
    assert [len(output.token_ids) for output in outputs] == [1, 1]
    assert len(calls) == 1 and calls[0][0] == 2
