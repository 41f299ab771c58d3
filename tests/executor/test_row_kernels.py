"""A steady step's bookkeeping in C (kernels/row_kernels.py) against the same in numpy
(RequestRows without kernels): the same admissions, the same gathered inputs, the same tables
and penalty counts after the step, whatever the rows hold."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from executor_service.kernels.cpu_kernels import KernelUnavailable
from executor_service.kernels.row_kernels import RowKernels, load_row_kernels
from executor_service.runner.request_rows import PENALISED as PENALISED_FLAG
from executor_service.runner.request_rows import PENALTY_ROW, RequestRows
from executor_service.runner.steady_decodes import SteadyDecodes
from executor_service.runner.validation import Limits
from executor_service.sampling.sampler_settings import SamplerSettings

VOCAB = 40
BLOCK_SIZE = 4
LIMITS = Limits(vocab_size=VOCAB, num_kv_blocks=48, block_size=BLOCK_SIZE, max_model_len=256, max_logprobs=5)
PENALISED = SamplerSettings(temperature=0.8, repetition_penalty=1.2, frequency_penalty=0.5)

# Per request: tokens known, how far its computed count lags one behind them, blocks it holds
# beyond those its known tokens fill less one (0: no room for its next token when they fill their
# last block), whether its first block id lies past the cache, whether it is penalised. Mostly
# rows a steady step admits, so that most lists are admitted whole.
REQUESTS = st.lists(
    st.tuples(
        st.integers(1, 30),
        st.sampled_from((0, 0, 0, 0, 0, 1, 2)),
        st.integers(0, 2),
        st.sampled_from((False, False, False, False, False, True)),
        st.booleans(),
    ),
    min_size=1,
    max_size=7,
)


def _kernels() -> RowKernels:
    try:
        return load_row_kernels()
    except KernelUnavailable as error:
        pytest.skip(f"the C kernels cannot be built here: {error}")


def _rows(kernels: RowKernels | None, requests: list[tuple[int, int, int, bool, bool]]) -> RequestRows:
    rows = RequestRows(VOCAB, torch.device("cpu"), kernels)
    for i, (known, lag, extra_blocks, past_cache, penalised) in enumerate(requests):
        block_ids = [7 * i + b for b in range(max(1, (known - 1) // BLOCK_SIZE + extra_blocks))]
        if past_cache:
            block_ids[0] = LIMITS.num_kv_blocks + i
        tokens = [(5 * i + t) % VOCAB for t in range(known)]
        computed = max(0, known - 1 - lag)
        rows.admit(f"r{i}", tokens, min(known, 3), block_ids, computed, PENALISED if penalised else SamplerSettings())
    return rows


@settings(max_examples=150, deadline=None)
@given(REQUESTS)
def test_the_c_gather_admits_and_gathers_what_numpy_does(requests: list[tuple[int, int, int, bool, bool]]) -> None:
    kernels = _kernels()
    steps = []
    for rows in (_rows(kernels, requests), _rows(None, requests)):
        held = {i + 1: state for i, state in enumerate(rows.states) if state is not None}
        steps.append(SteadyDecodes().admit(list(held), held, rows, LIMITS))
    c_step, numpy_step = steps
    assert (c_step is None) == (numpy_step is None)
    if c_step is None or numpy_step is None:
        return
    for name in ("last_tokens", "positions", "context_lens", "slots", "table"):
        assert np.array_equal(getattr(c_step, name), getattr(numpy_step, name)), name


@settings(max_examples=80, deadline=None)
@given(REQUESTS, st.integers(0, 2**31))
def test_the_c_write_back_leaves_the_tables_numpy_leaves(
    requests: list[tuple[int, int, int, bool, bool]], seed: int
) -> None:
    kernels = _kernels()
    # Rows one token behind with room: what a steady step writes back for.
    requests = [(known, 0, 2, False, penalised) for known, _, _, _, penalised in requests]
    sampled = np.random.default_rng(seed).integers(0, VOCAB, len(requests)).tolist()
    tables = []
    for rows in (_rows(kernels, requests), _rows(None, requests)):
        order = np.array([state.row for state in rows.states if state is not None][::-1], dtype=np.int64)
        rows.sampling(order)
        for _ in range(3):
            rows.decoded(order, sampled)
        counts_rows = torch.from_numpy(rows.ints[rows.flags[:, PENALISED_FLAG], PENALTY_ROW])
        tables.append((rows.ints, rows.tokens, rows.penalty_counts.gather(counts_rows)[0]))
    (c_ints, c_tokens, c_counts), (n_ints, n_tokens, n_counts) = tables
    assert np.array_equal(c_ints, n_ints)
    assert np.array_equal(c_tokens[:, : n_tokens.shape[1]], n_tokens)
    assert torch.equal(c_counts, n_counts)


def test_a_token_outside_the_vocabulary_is_refused_before_anything_is_written() -> None:
    rows = _rows(_kernels(), [(5, 0, 3, False, True)])
    order = np.array([0], dtype=np.int64)
    rows.sampling(order)
    before = rows.ints.copy(), rows.tokens.copy()
    with pytest.raises(ValueError, match="outside the vocabulary"):
        rows.decoded(order, [VOCAB + 3])
    width = before[1].shape[1]
    assert np.array_equal(rows.ints, before[0])
    assert np.array_equal(rows.tokens[:, :width], before[1]) and not rows.tokens[:, width:].any()


def _padded(table: np.ndarray, width: int) -> np.ndarray:
    return np.pad(table, ((0, 0), (0, width - table.shape[1])))


@settings(max_examples=60, deadline=None)
@given(
    st.lists(st.integers(1, 5), min_size=1, max_size=6),
    st.lists(st.lists(st.booleans(), min_size=6, max_size=6), min_size=1, max_size=12),
)
def test_the_kept_table_follows_block_appends_step_after_step(held: list[int], appends: list[list[bool]]) -> None:
    """The C gather copies only the blocks added since the last step (and lays its table out
    again when a row outgrows it); the table it keeps equals the one numpy gathers whole."""
    kernels = _kernels()
    limits = Limits(vocab_size=VOCAB, num_kv_blocks=1_000, block_size=BLOCK_SIZE, max_model_len=256, max_logprobs=5)
    sides = []
    for side_kernels in (kernels, None):
        rows = RequestRows(VOCAB, torch.device("cpu"), side_kernels)
        states = [rows.admit(f"r{i}", [1], 1, [100 * i + b for b in range(count)], 0, SamplerSettings()) for i, count in enumerate(held)]
        sides.append((rows, states, {i + 1: state for i, state in enumerate(states)}, SteadyDecodes()))
    for step in appends:
        tables = []
        for rows, states, handles, steady in sides:
            for i, (state, append) in enumerate(zip(states, step)):
                if append:
                    rows.add_blocks(state, [100 * i + len(state.block_ids)])
            admitted = steady.admit(list(handles), handles, rows, limits)
            assert admitted is not None
            tables.append(admitted.table.copy())
        width = max(table.shape[1] for table in tables)
        assert np.array_equal(_padded(tables[0], width), _padded(tables[1], width))
