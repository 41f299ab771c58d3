"""The int8 screen of greedy rows keeps every token a float32 lm_head could make the largest,
gives the kept tokens the packed head's logits bit for bit and every other token -inf, so its
greedy token is the packed head's, near-ties included; rows that read more than the argmax, rows
it cannot narrow and non-finite rows get the plain head's logits; an executor installs it only
over a head on the panel kernel's float path, and its tokens stay those of the plain head."""

from __future__ import annotations

import math
from collections.abc import Iterator
from pathlib import Path

import numpy as np
import pytest
import torch
from hypothesis import assume, given, settings
from hypothesis import strategies as st

from executor_service.cpu_forward.greedy_head import (
    MIN_DIM,
    OUTLIER_CHECK_EVERY,
    PAUSE_CALLS,
    GreedyScreen,
    Int8Head,
    ScreenedHead,
    float_panel_problem,
    int8_head_is_exact,
    matmul_rounding,
    quantize_vocab,
    screenable_head,
)
from executor_service.cpu_forward.packed_linear import PackedLinear
from executor_service.kernels.cpu_kernels import cpu_flags, load_kernel_library
from executor_service.kernels.panel_linear import PanelKernel
from executor_service.runner.request_rows import RequestRows
from executor_service.sampling.sampler_settings import SamplerSettings
from executor_service.serving.settings import ExecutorSettings
from executor_service.startup import startup
from protos.splitserve.executor.v1 import executor_pb2 as pb
from tests.helpers.c_kernels import load_or_skip, panels_without_amx
from tests.helpers.model_factory import build_config, build_model


@pytest.fixture(scope="module")
def library() -> object:
    return load_or_skip(load_kernel_library)


@pytest.fixture(scope="module")
def panels() -> Iterator[PanelKernel]:
    """The head's kernel wherever the screen is installed: the panel kernel's float path."""
    yield from panels_without_amx()


def linear_of(weight: torch.Tensor) -> torch.nn.Linear:
    linear = torch.nn.Linear(weight.shape[1], weight.shape[0], bias=False)
    with torch.no_grad():
        linear.weight.copy_(weight)
    return linear


def packed_head(weight: torch.Tensor, panels: PanelKernel) -> PackedLinear:
    return PackedLinear(linear_of(weight), panels)


def head_logits(weight: torch.Tensor, hidden: torch.Tensor, panels: PanelKernel) -> torch.Tensor:
    with torch.inference_mode():
        return packed_head(weight, panels)(hidden[None])[0]


def int8_linear_is_exact_here() -> bool:
    """oneDNN's int8 linear is exact on CPUs with VNNI (or AMX); on AVX2-only hosts it may
    saturate 16-bit sums, and the executor then keeps the plain head."""
    levels = quantize_vocab(torch.randn(64, MIN_DIM)).levels
    return int8_head_is_exact(Int8Head(levels), levels)


@pytest.fixture(scope="module")
def exact_library(library: object) -> object:
    if not int8_linear_is_exact_here():
        pytest.skip("oneDNN's int8 linear is not exact on this CPU (no VNNI): the screen is off here")
    return library


def exact_logits(hidden: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    return hidden.double() @ weight.double().t()


def assert_screen_keeps_every_contender(
    hidden: torch.Tensor, weight: torch.Tensor, logits: torch.Tensor, panels: PanelKernel
) -> None:
    """Every token within float32 rounding of the row's largest exact logit is kept, with the
    packed head's logit, bit for bit; every other token is -inf; the row's greedy token is the
    packed head's."""
    exact = exact_logits(hidden, weight)
    band = matmul_rounding(weight.shape[1]) * hidden.double().norm(dim=1)[:, None] * weight.double().norm(dim=1)
    contenders = exact + band >= (exact - band).amax(dim=1, keepdim=True)
    kept = torch.isfinite(logits)
    assert bool((kept | ~contenders).all()), "a token that could be the argmax was dropped"
    assert bool((logits[~kept] == -math.inf).all())
    plain = head_logits(weight, hidden, panels)
    assert torch.equal(logits[kept], plain[kept]), "a kept token's logit is not the packed head's"
    assert torch.equal(logits.argmax(dim=1), plain.argmax(dim=1))


def on_int8_grid(values: torch.Tensor) -> torch.Tensor:
    """Rows near `values` that the screen's rounding represents exactly: integer levels whose
    largest is 127, times a power of two."""
    levels = torch.round(values / values.abs().amax(dim=1, keepdim=True) * 127)
    exponent = torch.floor(torch.log2(values.abs().amax(dim=1, keepdim=True) / 127))
    return levels * 2.0**exponent


@st.composite
def heads(draw: st.DrawFn) -> tuple[torch.Tensor, torch.Tensor]:
    """A weight and hidden rows drawn so that each term of the bound must hold up on its own:
    - one side on the int8 grid, so that the other side's rounding alone decides the order;
    - twin vocabulary rows closer than int8 resolves (or, on the grid, one step apart) under
      hidden rows lined up with them, where the exact logits and the screen may disagree;
    - exact ties, one-ulp-apart rows, magnitudes 1e-20 to 1e20;
    - outlier hidden channels (taken out of the int8 product), one whose part cancels a token's
      logit, and twins that differ only there."""
    vocab = draw(st.integers(2, 300))
    dim = draw(st.integers(MIN_DIM, 96))
    rows = draw(st.integers(1, 6))
    generator = torch.Generator().manual_seed(draw(st.integers(0, 2**31)))
    weight = torch.randn(vocab, dim, generator=generator) * 10.0 ** draw(st.integers(-20, 20))
    hidden = torch.randn(rows, dim, generator=generator) * 10.0 ** draw(st.integers(-20, 20))
    if draw(st.booleans()):
        weight[vocab - 1] = weight[0]
    if draw(st.booleans()) and vocab > 2:
        weight[1] = torch.nextafter(weight[0], torch.full_like(weight[0], math.inf))
    scenario = draw(st.sampled_from(["random", "grid-weight", "grid-weight-twins", "grid-hidden-twins"]))
    if scenario.startswith("grid-weight"):
        weight = on_int8_grid(weight)
    if scenario == "grid-weight-twins":
        # A twin one grid step away in many coordinates, and hidden rows along the first row
        # on which the twin wins by a hair: int8 rounding of the hidden rows can reverse that.
        step = weight[0].abs().max() / 127
        signs = torch.randint(0, 2, (dim,), generator=generator).float() * 2 - 1
        signs[weight[0].abs() >= 126 * step] = 0
        weight[vocab - 1] = weight[0] + step * signs
        hidden = weight[0] + torch.randn(rows, dim, generator=generator) * step * 3
        margin = 1e-3 * hidden.abs().amax(dim=1)
        hidden -= ((hidden @ signs - margin) / signs.square().sum().clamp(min=1))[:, None] * signs
    if scenario == "grid-hidden-twins":
        noise = torch.randn(dim, generator=generator) * weight[0].abs().max() * 1e-3
        weight[vocab - 1] = weight[0] + noise
        jitter = torch.randn(rows, dim, generator=generator) * 1e-2 * weight[0].abs().max()
        hidden = on_int8_grid(weight[0].expand(rows, dim) + jitter)
    elif draw(st.booleans()):
        # The hidden row lines up with a vocabulary row: a clear winner and its near copies.
        hidden[0] = weight[draw(st.integers(0, vocab - 1))]
    if draw(st.booleans()):
        # Outlier channels, taken out of the int8 product.
        outliers = torch.randperm(dim, generator=generator)[: draw(st.integers(1, 3))]
        hidden[:, outliers] = hidden[:, outliers].sign() * hidden.abs().amax() * draw(st.sampled_from([8.0, 1000.0]))
        outlier = int(outliers[0])
        if draw(st.booleans()):
            # The outlier's part of token 0's logit cancels the rest of it for the first row.
            rest = hidden[0] @ weight[0] - hidden[0, outlier] * weight[0, outlier]
            weight[0, outlier] = -rest / hidden[0, outlier]
        if draw(st.booleans()) and vocab > 2:
            # A twin of token 0 that differs only at the outlier, by one float32 step.
            weight[2] = weight[0]
            weight[2, outlier] = torch.nextafter(weight[0, outlier], torch.tensor(math.inf))
    return weight, hidden


@settings(max_examples=300, deadline=None)
@given(head=heads(), threads=st.sampled_from([1, 2]), stale_outliers=st.integers(0, 3))
def test_the_screen_keeps_every_token_that_could_be_the_argmax(
    exact_library: object, panels: PanelKernel, head: tuple[torch.Tensor, torch.Tensor], threads: int,
    stale_outliers: int,
) -> None:
    weight, hidden = head
    screen = GreedyScreen(exact_library, weight)
    assert screen.is_exact()
    if stale_outliers:
        # An earlier call may teach the screen outlier channels these rows do not have; after a
        # full round of calls, the checked call is the one below, which may add this draw's own.
        earlier = torch.randn(2, weight.shape[1])
        earlier[:, torch.randperm(weight.shape[1])[:stale_outliers]] = 1000.0
        for _ in range(OUTLIER_CHECK_EVERY):
            screen.logits(earlier)
    # Rows whose logits could pass float32's range take the plain head (tested below).
    hidden = hidden[torch.tensor(screen.screenable_rows(hidden))]
    assume(hidden.shape[0] > 0)
    previous = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        logits, wide = screen.logits(hidden)
    finally:
        torch.set_num_threads(previous)
    narrowed = [r for r in range(hidden.shape[0]) if r not in wide]
    assert_screen_keeps_every_contender(hidden[narrowed], weight, logits[narrowed], panels)


def test_a_random_llama_head_keeps_a_few_dozen_tokens_and_the_float32_argmax(
    library: object, panels: PanelKernel
) -> None:
    torch.manual_seed(0)
    weight = torch.randn(32000, 512) * 0.02
    hidden = torch.randn(64, 512)
    logits, wide = GreedyScreen(library, weight).logits(hidden)
    assert wide == []
    assert int(torch.isfinite(logits).sum(dim=1).max()) < 200
    assert_screen_keeps_every_contender(hidden, weight, logits, panels)


def test_on_near_ties_the_screen_picks_the_packed_heads_token_not_the_exact_maths(
    library: object, panels: PanelKernel
) -> None:
    """Twin vocabulary rows one float32 step apart in a few coordinates, under hidden rows lined
    up with them: the exact logits and the float32 head's order the twins differently on some
    rows, and the screen must follow the head (scoring kept tokens in double precision did not)."""
    generator = torch.Generator().manual_seed(3)
    dim, vocab, rows = 512, 4096, 512
    weight = torch.randn(vocab, dim, generator=generator) * 0.02
    twins = torch.arange(0, 2 * rows, 2) % vocab
    nudged = torch.randint(0, dim, (rows, 4), generator=generator)
    for twin, channels in zip(twins.tolist(), nudged):
        weight[twin + 1] = weight[twin]
        weight[twin + 1, channels] = torch.nextafter(weight[twin, channels], torch.tensor(math.inf))
    hidden = 3 * weight[twins] + 0.01 * torch.randn(rows, dim, generator=generator)
    logits, wide = GreedyScreen(library, weight).logits(hidden)
    assert wide == []
    plain = head_logits(weight, hidden, panels)
    exact_picks = exact_logits(hidden, weight).argmax(dim=1)
    assert int((exact_picks != plain.argmax(dim=1)).sum()) > 0, "no near-tie here: the test would prove nothing"
    assert_screen_keeps_every_contender(hidden, weight, logits, panels)


def test_a_row_the_bound_cannot_narrow_is_left_to_the_plain_head(library: object) -> None:
    # A zero row ties every token: the screen keeps them all, which is more than it takes on.
    weight = torch.randn(64, MIN_DIM)
    logits, wide = GreedyScreen(library, weight).logits(torch.stack([torch.zeros(MIN_DIM), weight[5]]))
    assert wide == [0]
    assert int(logits[1].argmax()) == 5


def test_outlier_channels_are_learned_on_one_call_in_sixteen_and_kept(library: object, panels: PanelKernel) -> None:
    screen = GreedyScreen(library, torch.randn(300, 64))

    def rows_with_outlier(channel: int) -> torch.Tensor:
        rows = torch.randn(4, 64)
        rows[:, channel] = 100.0
        return rows

    screen.logits(rows_with_outlier(3))
    assert screen.outliers == [3]
    for _ in range(OUTLIER_CHECK_EVERY - 1):
        screen.logits(rows_with_outlier(5))
    assert screen.outliers == [3]
    rows = rows_with_outlier(5)
    logits, wide = screen.logits(rows)
    assert screen.outliers == [3, 5] and wide == []
    assert_screen_keeps_every_contender(rows, screen.weight, logits, panels)


def wrapped_head(library: object, panels: PanelKernel, vocab: int = 500, dim: int = 32) -> tuple[ScreenedHead, PackedLinear]:
    torch.manual_seed(1)
    weight = torch.nn.Linear(dim, vocab, bias=False).weight.detach()
    plain = packed_head(weight, panels)
    return ScreenedHead(packed_head(weight, panels), GreedyScreen(library, weight)), plain


def test_rows_that_read_more_than_the_argmax_get_the_plain_heads_logits(library: object, panels: PanelKernel) -> None:
    head, plain_head = wrapped_head(library, panels)
    hidden = torch.randn(1, 5, 32)
    hidden[0, 3, 0] = math.nan
    hidden[0, 4] *= 1e36
    plain = plain_head(hidden)
    with head.argmax_only_rows([True, False, True, True, True]):
        logits = head(hidden)
    assert logits.shape == plain.shape
    # The sampled row, and the NaN row and the row near float32's range that the screen refuses,
    # are the plain head's (the panel kernel's rows do not depend on the rows beside them).
    torch.testing.assert_close(logits[0, [1, 3, 4]], plain[0, [1, 3, 4]], rtol=0, atol=0, equal_nan=True)
    kept = torch.isfinite(logits[0, [0, 2]])
    assert torch.equal(logits[0, [0, 2]][kept], plain[0, [0, 2]][kept])
    assert torch.equal(logits[0, [0, 2]].argmax(dim=-1), plain[0, [0, 2]].argmax(dim=-1))
    assert bool(torch.isinf(logits[0, 0]).any()) and bool(torch.isinf(logits[0, 2]).any())
    # Outside the context every row is the plain head's.
    torch.testing.assert_close(head(hidden), plain, rtol=0, atol=0, equal_nan=True)
    # Model code reads the head's weight (transformers' Mamba casts to lm_head.weight.dtype).
    assert head.weight.dtype == torch.float32 and head.weight.shape == plain_head.weight.shape


def test_after_a_call_it_could_not_narrow_the_screen_pauses(
    library: object, panels: PanelKernel, monkeypatch: pytest.MonkeyPatch
) -> None:
    head, _ = wrapped_head(library, panels)
    calls: list[int] = []
    screen_logits = head.screen.logits
    monkeypatch.setattr(
        head.screen, "logits", lambda rows, learn=True: calls.append(len(rows)) or screen_logits(rows, learn)
    )
    # Zero rows tie every token: too wide to narrow, the plain head answers them.
    for _ in range(1 + PAUSE_CALLS):
        with head.argmax_only_rows([True] * 4):
            assert torch.equal(head(torch.zeros(1, 4, 32)).argmax(dim=-1), torch.zeros(1, 4, dtype=torch.long))
    assert calls == [4]
    with head.argmax_only_rows([True] * 4):
        head(torch.randn(1, 4, 32))
    assert calls == [4, 4]


def test_the_screen_goes_only_over_a_head_whose_bits_it_gives(library: object, panels: PanelKernel) -> None:
    torch.manual_seed(2)
    weight = torch.randn(1000, 64)
    linear = linear_of(weight)
    assert float_panel_problem(packed_head(weight, panels)) is None
    assert "not on the panel kernel" in float_panel_problem(PackedLinear(linear))
    assert "not on the panel kernel" in float_panel_problem(linear)
    panels.use_amx(True)
    try:
        if panels.amx:
            assert "AMX" in float_panel_problem(packed_head(weight, panels))
    finally:
        panels.use_amx(False)
    screen = GreedyScreen(library, weight)
    assert screen.matches(packed_head(weight, panels))
    # A head whose logits differ in their last bits is refused.
    assert not screen.matches(packed_head(weight * (1 + 2.0**-20), panels))


def test_only_plain_float32_heads_are_screened() -> None:
    from transformers import AutoModelForCausalLM

    llama = AutoModelForCausalLM.from_config(build_config("llama"), dtype=torch.float32)
    assert screenable_head(llama) is llama.get_output_embeddings()
    # A tanh soft-cap can tie tokens that differ before it.
    gemma = AutoModelForCausalLM.from_config(build_config("gemma2"), dtype=torch.float32)
    assert gemma.config.final_logit_softcapping is not None
    assert screenable_head(gemma) is None
    assert screenable_head(llama.to(torch.bfloat16)) is None


def _argmax_only(settings: SamplerSettings, num_outputs: int) -> bool:
    rows = RequestRows(vocab_size=8, device=torch.device("cpu"))
    state = rows.admit("r", [3] + [4] * num_outputs, 1, [0], 0, settings)
    return rows.argmax_only(np.array([state.row]))[0]


def test_argmax_only_is_greedy_without_penalties_logprobs_or_masked_stops() -> None:
    assert _argmax_only(SamplerSettings(), 0)
    assert not _argmax_only(SamplerSettings(temperature=0.7), 0)
    assert not _argmax_only(SamplerSettings(repetition_penalty=1.1), 0)
    assert not _argmax_only(SamplerSettings(want_logprobs=True), 0)
    masked = SamplerSettings(min_tokens=2, min_tokens_stop_ids=(2,))
    assert not _argmax_only(masked, 1) and _argmax_only(masked, 2)


Outputs = dict[str, tuple[list[int], list[float]]]


def run_steps(runner: object, requests: dict[str, tuple[list[int], pb.SamplerConfig]], steps: int) -> Outputs:
    """Each request's tokens and chosen-token logprobs over a prefill step and decode steps."""
    outputs: Outputs = {name: ([], []) for name in requests}
    plan = pb.StepPlan(
        step_id=1,
        new_requests=[
            pb.NewRequest(
                request_id=name,
                token_ids=ids,
                block_ids=[2 * i, 2 * i + 1],
                num_scheduled_tokens=len(ids),
                sampling=sampling,
            )
            for i, (name, (ids, sampling)) in enumerate(requests.items())
        ],
    )
    for step_id in range(2, steps + 2):
        for output in runner.execute(plan).outputs:
            outputs[output.request_id][0].extend(output.token_ids)
            outputs[output.request_id][1].extend(entry.logprob for entry in output.logprobs)
        plan = pb.StepPlan(
            step_id=step_id,
            continuing_requests=[pb.ContinuingRequest(request_id=name, num_scheduled_tokens=1) for name in requests],
        )
    return outputs


def test_an_executor_screens_greedy_rows_and_every_row_samples_as_with_the_plain_head(
    library: object, tmp_path: Path
) -> None:
    model_dir = build_model("llama", tmp_path)
    requests = {
        "greedy": ([5, 6, 7, 8], pb.SamplerConfig()),
        "greedy-with-logprobs": ([9, 10, 11], pb.SamplerConfig(want_logprobs=True, num_logprobs=2)),
        "seeded-draw": ([3], pb.SamplerConfig(temperature=0.8, has_seed=True, seed=11)),
        "stop-masked": ([4, 4], pb.SamplerConfig(min_tokens=3, min_tokens_stop_ids=[2])),
    }
    outputs = {}
    # Where the int8 linear is exact and the head is on the panel kernel (AVX-512F).
    screened_here = int8_linear_is_exact_here() and "avx512f" in cpu_flags()
    for screen in (True, False):
        settings = ExecutorSettings(
            model_dir=model_dir, device="cpu", num_kv_blocks=8, block_size=8, greedy_screen=screen
        )
        runner = startup.build_executor(settings).runner
        assert isinstance(runner.loaded.model.get_output_embeddings(), ScreenedHead) == (screen and screened_here)
        outputs[screen] = run_steps(runner, requests, steps=6)
    for name in requests:
        (tokens, logprobs), (plain_tokens, plain_logprobs) = outputs[True][name], outputs[False][name]
        assert tokens == plain_tokens and len(tokens) == 6, name
        assert logprobs == pytest.approx(plain_logprobs, rel=1e-5), name
    assert len(outputs[True]["greedy-with-logprobs"][1]) == 6
