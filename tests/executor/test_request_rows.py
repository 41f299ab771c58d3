"""The persistent batch (runner/request_rows.py): steady decodes whose inputs and sampling batch
are gathered from the rows' arrays sample exactly what the same requests sample as continuing
entries built from their token and block lists, penalty counts kept step by step equal a
recount, and the steady-decode check over all rows at once agrees with the per-request one; with
the steady bookkeeping in C (RowKernels) and in numpy."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from executor_service.kernels.cpu_kernels import KernelUnavailable
from executor_service.kernels.row_kernels import RowKernels
from executor_service.runner import model_runner
from executor_service.runner.model_runner import ModelRunner
from executor_service.runner.request_rows import RequestRows
from executor_service.runner.steady_decodes import SteadyDecodes
from executor_service.runner.validation import Limits, check_decode
from executor_service.sampling.sampler_settings import SamplerSettings
from executor_service.serving.settings import ExecutorSettings
from executor_service.startup import startup
from executor_service.startup.startup import build_executor
from protos.limits import UNHELD_DECODE_TOKEN
from protos.splitserve.executor.v1 import executor_pb2 as pb
from tests.helpers.model_factory import VOCAB_SIZE, build_model

BLOCK_SIZE = 4
STEPS = 9
PROMPT = [5, 6, 7, 9, 11]
SAMPLING = [
    pb.SamplerConfig(),
    pb.SamplerConfig(
        temperature=0.9, top_p=0.9, repetition_penalty=1.3, presence_penalty=0.4,
        frequency_penalty=0.3, seed=11, has_seed=True,
    ),
    pb.SamplerConfig(repetition_penalty=1.5),
    pb.SamplerConfig(temperature=0.7, top_k=5, seed=3, has_seed=True),
    pb.SamplerConfig(min_tokens=4, min_tokens_stop_ids=[2, 17]),
    pb.SamplerConfig(logit_bias_token_ids=[7, 9], logit_bias_values=[30.0, -100.0]),
    pb.SamplerConfig(temperature=1.0, seed=5, has_seed=True, allowed_token_ids=[3, 8, 21]),
]
BLOCKS_PER_REQUEST = 5


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return build_model("llama", tmp_path_factory.mktemp("llama"))


@pytest.fixture(params=["c", "numpy"])
def bookkeeping(request: pytest.FixtureRequest, monkeypatch: pytest.MonkeyPatch) -> str:
    """Steady steps' bookkeeping through RowKernels, or numpy's where the kernels cannot be had."""
    if request.param == "numpy":
        def unavailable() -> RowKernels:
            raise KernelUnavailable("numpy's bookkeeping asked for")

        monkeypatch.setattr(startup, "load_row_kernels", unavailable)
    return str(request.param)


def _runner(model_dir: Path, bookkeeping: str) -> ModelRunner:
    torch.set_num_threads(1)
    settings = ExecutorSettings(
        model_dir=model_dir, device="cpu", num_kv_blocks=len(SAMPLING) * BLOCKS_PER_REQUEST, block_size=BLOCK_SIZE
    )
    runner = build_executor(settings).runner
    assert runner.backend == "cpu_paged"
    assert (runner.rows.kernels is not None) == (bookkeeping == "c")
    return runner


def _first_step(runner: ModelRunner) -> list[int]:
    plan = pb.StepPlan(step_id=1)
    for i, sampling in enumerate(SAMPLING):
        plan.new_requests.add(
            request_id=f"r{i}", handle=i + 1, token_ids=PROMPT, block_ids=[i * BLOCKS_PER_REQUEST, i * BLOCKS_PER_REQUEST + 1],
            num_scheduled_tokens=len(PROMPT), sampling=sampling,
        )
    result = runner.execute(plan)
    assert not result.rejected and not result.HasField("failure")
    return [output.token_ids[0] for output in result.outputs]


def _appended_block(request: int, position: int) -> int | None:
    """The block a request needs for the token at this position, when it starts a new block."""
    if position % BLOCK_SIZE:
        return None
    return request * BLOCKS_PER_REQUEST + position // BLOCK_SIZE


def test_gathered_steady_decodes_sample_what_continuing_entries_sample(
    model_dir: Path, monkeypatch: pytest.MonkeyPatch, bookkeeping: str
) -> None:
    gathered: list[int] = []
    real = model_runner.build_decode_inputs
    monkeypatch.setattr(
        model_runner, "build_decode_inputs", lambda *args: gathered.append(1) or real(*args)
    )
    by_handle, by_entry = _runner(model_dir, bookkeeping), _runner(model_dir, bookkeeping)
    tokens_by_handle = [[t] for t in _first_step(by_handle)]
    tokens_by_entry = [[t] for t in _first_step(by_entry)]
    for step in range(STEPS):
        position = len(PROMPT) + step
        handles = pb.StepPlan(step_id=2 + step, decode_handles=range(1, len(SAMPLING) + 1))
        entries = pb.StepPlan(step_id=2 + step)
        for i in range(len(SAMPLING)):
            block = _appended_block(i, position)
            if block is not None:
                handles.decode_block_handles.append(i + 1)
                handles.decode_block_ids.append(block)
            entries.continuing_requests.add(
                request_id=f"r{i}", num_scheduled_tokens=1, new_block_ids=[] if block is None else [block]
            )
        one, other = by_handle.execute(handles), by_entry.execute(entries)
        assert not one.rejected and not other.rejected
        for i in range(len(SAMPLING)):
            tokens_by_handle[i].append(one.decode_token_ids[i])
            tokens_by_entry[i].append(other.outputs[i].token_ids[0])
    assert len(gathered) == STEPS, "the steady decodes did not take their inputs from the rows"
    assert tokens_by_handle == tokens_by_entry
    assert not {2, 17} & set(tokens_by_handle[4][:4]), "min_tokens let a stop id through"
    assert tokens_by_handle[5] == [7] * (STEPS + 1), "a +30 bias did not take the greedy choice"
    assert set(tokens_by_handle[6]) <= {3, 8, 21}, "a token outside allowed_token_ids was sampled"
    for runner in (by_handle, by_entry):
        for i in range(len(SAMPLING)):
            state = runner.requests[f"r{i}"]
            assert state.block_ids == list(range(i * BLOCKS_PER_REQUEST, i * BLOCKS_PER_REQUEST + 4))
            assert state.num_computed_tokens == len(PROMPT) + STEPS


def test_penalty_counts_kept_step_by_step_equal_a_recount(model_dir: Path, bookkeeping: str) -> None:
    runner = _runner(model_dir, bookkeeping)
    _first_step(runner)
    for step in range(STEPS):
        position = len(PROMPT) + step
        plan = pb.StepPlan(step_id=2 + step, decode_handles=range(1, len(SAMPLING) + 1))
        for i in range(len(SAMPLING)):
            block = _appended_block(i, position)
            if block is not None:
                plan.decode_block_handles.append(i + 1)
                plan.decode_block_ids.append(block)
        runner.execute(plan)
    rows = runner.rows
    for name in ("r1", "r2"):
        state = runner.requests[name]
        counts_row = torch.tensor([int(rows.ints[state.row, 5])])
        output_counts, prompt_seen = rows.penalty_counts.gather(counts_row)
        recount = torch.bincount(torch.tensor(state.output_token_ids), minlength=VOCAB_SIZE).float()
        assert torch.equal(output_counts[0], recount)
        assert torch.equal(prompt_seen[0], torch.bincount(torch.tensor(PROMPT), minlength=VOCAB_SIZE) > 0)


LIMITS = Limits(vocab_size=VOCAB_SIZE, num_kv_blocks=64, block_size=BLOCK_SIZE, max_model_len=256, max_logprobs=5)


@settings(max_examples=60, deadline=None)
@given(
    st.lists(
        st.tuples(st.integers(1, 20), st.integers(0, 3), st.integers(0, 6)), min_size=1, max_size=6
    ),
)
def test_the_vectorised_steady_decode_check_agrees_with_the_per_request_one(
    requests: list[tuple[int, int, int]]
) -> None:
    """Each request: (tokens known, tokens not yet computed beyond the last, blocks held)."""
    rows = RequestRows(VOCAB_SIZE, torch.device("cpu"))
    states = [
        rows.admit(f"r{i}", [3] * known, known, list(range(8 * i, 8 * i + blocks)), max(0, known - 1 - behind), SamplerSettings())
        for i, (known, behind, blocks) in enumerate(requests)
    ]
    held = {i + 1: state for i, state in enumerate(states)}
    each_passes = all(check_decode(state, LIMITS) is None for state in states)
    steady = SteadyDecodes().admit(list(held), held, rows, LIMITS)
    assert (steady is not None) == each_passes
    if steady is not None:
        assert steady.states == states
        assert steady.rows.tolist() == [state.row for state in states]


def test_a_handle_named_twice_in_a_plan_of_steady_decodes_is_refused_once(model_dir: Path, bookkeeping: str) -> None:
    runner = _runner(model_dir, bookkeeping)
    _first_step(runner)
    result = runner.execute(pb.StepPlan(step_id=2, decode_handles=[1, 2, 1]))
    assert [(r.request_id, "twice" in r.message) for r in result.rejected] == [("r0", True)]
    assert result.decode_token_ids[2] == UNHELD_DECODE_TOKEN
    assert UNHELD_DECODE_TOKEN not in result.decode_token_ids[:2]


def test_rows_with_shaped_logits_are_not_argmax_only() -> None:
    rows = RequestRows(VOCAB_SIZE, torch.device("cpu"))
    plain = rows.admit("plain", [3, 4], 2, [0], 0, SamplerSettings())
    biased = rows.admit("biased", [3, 4], 2, [1], 0, SamplerSettings(logit_bias=((5, 2.0),)))
    allowed = rows.admit("allowed", [3, 4], 2, [2], 0, SamplerSettings(allowed_token_ids=(5, 6)))
    order = np.array([plain.row, biased.row, allowed.row], dtype=np.int64)
    assert rows.argmax_only(order) == [True, False, False]
