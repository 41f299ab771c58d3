"""A fused Llama's pure decode steps run their layers as one C call (the decode program), whose
logits and K/V writes are the Python layer loop's bit for bit; steps with prompt tokens keep the
loop, and models off the C kernels have no program. Weights made of 4-bit blocks are read from
them at decode sizes, with the float weights' bits (AMX off) or within float32 rounding of them
(on AMX's tiles)."""

from __future__ import annotations

import logging
import re
from pathlib import Path
from typing import Any

import pytest
import torch
from safetensors.torch import load_file, save_file

from executor_service.cpu_forward.packed_linear import PackedLinear
from executor_service.kernels.panel_linear import load_panel_kernel
from executor_service.runner import model_runner
from executor_service.runner.forward import compute_logits
from executor_service.serving.settings import ExecutorSettings
from executor_service.startup import startup
from protos.splitserve.executor.v1 import executor_pb2 as pb
from tests.helpers.c_kernels import load_or_skip, skip_without_amx
from tests.helpers.model_factory import build_model


def _runner(model_dir: Path, **overrides: object) -> model_runner.ModelRunner:
    settings = ExecutorSettings(model_dir=model_dir, device="cpu", num_kv_blocks=32, block_size=8, **overrides)
    return startup.build_executor(settings).runner


def _plans() -> list[pb.StepPlan]:
    """Three prompts of different lengths (one of two chunks), then decodes that cross blocks;
    "b" samples, the others are greedy."""
    greedy, sampled = pb.SamplerConfig(), pb.SamplerConfig(temperature=0.9, has_seed=True, seed=5)
    plans = [
        pb.StepPlan(step_id=1, new_requests=[
            pb.NewRequest(request_id="a", token_ids=list(range(3, 16)), block_ids=[0, 1, 2, 3],
                          num_scheduled_tokens=13, sampling=greedy),
            pb.NewRequest(request_id="b", token_ids=list(range(40, 45)), block_ids=[4, 5, 6],
                          num_scheduled_tokens=5, sampling=sampled),
            pb.NewRequest(request_id="c", token_ids=list(range(100, 130)), block_ids=[7, 8, 9, 10, 11],
                          num_scheduled_tokens=20, sampling=greedy),
        ]),
        pb.StepPlan(step_id=2, continuing_requests=[
            pb.ContinuingRequest(request_id="a", num_scheduled_tokens=1),
            pb.ContinuingRequest(request_id="b", num_scheduled_tokens=1),
            pb.ContinuingRequest(request_id="c", num_scheduled_tokens=10),
        ]),
    ]
    for step_id in range(3, 12):
        plans.append(pb.StepPlan(step_id=step_id, continuing_requests=[
            pb.ContinuingRequest(request_id=name, num_scheduled_tokens=1) for name in ("a", "b", "c")
        ]))
    return plans


@pytest.mark.parametrize(
    "shape",
    [
        {},
        # heads of 64 (the decode kernel's unrolled width), biases on every projection
        {"hidden_size": 128, "num_attention_heads": 2, "num_key_value_heads": 1,
         "attention_bias": True, "mlp_bias": True},
    ],
    ids=["heads-of-16", "heads-of-64-with-biases"],
)
def test_decode_steps_through_the_program_give_the_layer_loops_logits_and_kv(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, shape: dict[str, Any]
) -> None:
    load_or_skip(load_panel_kernel, "avx512f")
    runner = _runner(build_model("llama", tmp_path / "llama", **shape))
    lean = runner.loaded.lean
    assert lean is not None and lean.program is not None
    program = lean.program
    kinds: list[str] = []

    def both(loaded: Any, inputs: Any, use_logits_to_keep: bool) -> torch.Tensor:
        step, cache = inputs.attention, runner.kv_cache
        if not program.covers(step):
            kinds.append("loop")
            return compute_logits(loaded, inputs, use_logits_to_keep)
        kinds.append("program")
        lean.program = None
        try:
            reference = compute_logits(loaded, inputs, use_logits_to_keep)
        finally:
            lean.program = program
        written = [tuple(t.clone() for t in cache.layer(i)) for i in range(runner.loaded.num_layers)]
        # The loop wrote this step's K/V; wipe it so that only the program's writes can restore it.
        for i in range(runner.loaded.num_layers):
            for tensor in cache.layer(i):
                tensor[step.slot_mapping] = 0.0
        got = compute_logits(loaded, inputs, use_logits_to_keep)
        assert torch.equal(got, reference)
        for i, (keys, values) in enumerate(written):
            assert torch.equal(cache.layer(i)[0], keys) and torch.equal(cache.layer(i)[1], values)
        return got

    monkeypatch.setattr(model_runner, "compute_logits", both)
    for plan in _plans():
        result = runner.execute(plan)
        assert not result.rejected
    assert kinds == ["loop", "loop"] + ["program"] * 9


def test_models_off_the_c_kernels_have_no_program(tmp_path: Path) -> None:
    load_or_skip(load_panel_kernel, "avx512f")
    llama = build_model("llama", tmp_path / "llama")
    assert _runner(llama).loaded.lean.program is not None
    # oneDNN GEMMs: the layers run, but not on the kernels the program calls.
    lean = _runner(llama, panel_linear=False).loaded.lean
    assert lean is not None and lean.program is None


def _four_bit(weight: torch.Tensor) -> torch.Tensor:
    """The weight rounded as GGUF's Q4_1 dequantizes it: per 32 inputs, fma(d, q, m) with m the
    block's least value and d a half-precision step (d * q is exact, so one rounding)."""
    blocks = weight.reshape(weight.shape[0], -1, 32)
    low, high = blocks.amin(-1, keepdim=True), blocks.amax(-1, keepdim=True)
    step = ((high - low) / 15).half().float().clamp_min(2.0**-14)
    levels = ((blocks - low) / step).round().clamp(0, 15)
    return (step * levels + low).reshape(weight.shape)


@pytest.mark.parametrize("amx", [False, True], ids=["float-path", "amx"])
def test_four_bit_weights_give_the_float_weights_logits_and_kv(
    tmp_path: Path, amx: bool, caplog: pytest.LogCaptureFixture
) -> None:
    """A model dequantized from 4-bit blocks (as the default SmolLM2 copy is): its linears keep
    the blocks, decode steps read them (through the program and the loop alike), and every step's
    logits and K/V are those of the same weights read as floats (--no-weight-blocks): their bits
    on the float path, within float32 rounding on AMX's tiles (which every call with blocks
    takes, prefill too)."""
    panels = load_or_skip(load_panel_kernel, "avx512f")
    if amx:
        skip_without_amx()
    model_dir = build_model("llama", tmp_path / "llama")
    path = model_dir / "model.safetensors"
    weights = load_file(path)
    save_file({name: _four_bit(t) if name.endswith("proj.weight") else t for name, t in weights.items()}, path)
    try:
        with caplog.at_level(logging.INFO, logger="executor_service.cpu_forward.fused_layers"):
            _compare_four_bit_with_floats(model_dir, amx)
        # The start-up log says how many of the fused layers' linears read blocks: every one,
        # then none with --no-weight-blocks.
        fused = [r.getMessage() for r in caplog.records if r.getMessage().startswith("event=layers_fused")]
        counts = [re.search(r"linears=(\d+) four_bit_blocks=(\d+)$", line) for line in fused]
        assert len(counts) == 2 and all(counts)
        (linears, with_blocks), (also_linears, without) = (map(int, m.groups()) for m in counts if m)
        assert linears == also_linears > 0 and with_blocks == linears and without == 0
        assert panels.amx == amx
    finally:
        panels.use_amx(True)


def _compare_four_bit_with_floats(model_dir: Path, amx: bool) -> None:
    def same(got: torch.Tensor, expected: torch.Tensor) -> bool:
        return torch.allclose(got, expected, rtol=1e-5, atol=1e-5) if amx else torch.equal(got, expected)

    with_blocks, as_floats = _runner(model_dir, amx=amx), _runner(model_dir, amx=amx, weight_blocks=False)

    def linears(runner: model_runner.ModelRunner) -> list[PackedLinear]:
        return [m for m in runner.loaded.model.modules() if isinstance(m, PackedLinear)]

    assert sum(m.blocks is not None for m in linears(with_blocks)) == len(linears(with_blocks)) - 1  # all but the lm_head
    # --no-weight-blocks: the same weights, every one read as floats.
    assert linears(as_floats) and all(m.blocks is None for m in linears(as_floats))
    assert as_floats.loaded.lean.program is not None
    logits: dict[int, list[torch.Tensor]] = {id(with_blocks): [], id(as_floats): []}
    original = model_runner.compute_logits
    for runner in (with_blocks, as_floats):
        def recording(loaded: Any, inputs: Any, use_logits_to_keep: bool, runner: Any = runner) -> torch.Tensor:
            result = original(loaded, inputs, use_logits_to_keep)
            logits[id(runner)].append(result.clone())
            return result

        with pytest.MonkeyPatch.context() as patch:
            patch.setattr(model_runner, "compute_logits", recording)
            for plan in _plans():
                assert not runner.execute(plan).rejected
    assert len(logits[id(with_blocks)]) == len(_plans())
    for got, expected in zip(logits[id(with_blocks)], logits[id(as_floats)], strict=True):
        assert same(got, expected)
    for i in range(with_blocks.loaded.num_layers):
        for got, expected in zip(with_blocks.kv_cache.layer(i), as_floats.kv_cache.layer(i), strict=True):
            assert same(got, expected)
