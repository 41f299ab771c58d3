"""An executor serving a fused Llama runs its steps through the lean forward, whose logits are
transformers' forward's over the same fused modules bit for bit (a prefill, a chunked prefill
beside a decode, decodes; greedy rows through the screen and a sampled row), and any other model
keeps transformers' forward."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from executor_service.cpu_forward.fused_layers import FusedMLP
from executor_service.cpu_forward.lean_forward import LeanLlama, lean_llama
from executor_service.cpu_forward.packed_linear import packing_available
from executor_service.runner import model_runner
from executor_service.runner.forward import compute_logits
from executor_service.serving.settings import ExecutorSettings
from executor_service.startup import startup
from protos.splitserve.executor.v1 import executor_pb2 as pb
from tests.helpers.model_factory import build_model

pytestmark = pytest.mark.skipif(
    not packing_available(torch.device("cpu"), torch.float32), reason="no oneDNN in this torch"
)


def _runner(model_dir: Path, **overrides: object) -> model_runner.ModelRunner:
    settings = ExecutorSettings(model_dir=model_dir, device="cpu", num_kv_blocks=16, block_size=8, **overrides)
    return startup.build_executor(settings).runner


def _plans() -> list[pb.StepPlan]:
    """"a" prefilled at once, "b" in two chunks, the second beside a's first decode, then decodes."""
    greedy, sampled = pb.SamplerConfig(), pb.SamplerConfig(temperature=0.9, has_seed=True, seed=5)
    plans = [
        pb.StepPlan(step_id=1, new_requests=[
            pb.NewRequest(request_id="a", token_ids=list(range(3, 16)), block_ids=[0, 1, 2],
                          num_scheduled_tokens=13, sampling=greedy),
            pb.NewRequest(request_id="b", token_ids=list(range(40, 60)), block_ids=[3, 4],
                          num_scheduled_tokens=12, sampling=sampled),
        ]),
        pb.StepPlan(step_id=2, continuing_requests=[
            pb.ContinuingRequest(request_id="a", num_scheduled_tokens=1),
            pb.ContinuingRequest(request_id="b", num_scheduled_tokens=8, new_block_ids=[5]),
        ]),
    ]
    for step_id in range(3, 7):
        plans.append(pb.StepPlan(step_id=step_id, continuing_requests=[
            pb.ContinuingRequest(request_id=name, num_scheduled_tokens=1) for name in ("a", "b")
        ]))
    return plans


def test_steps_through_the_lean_forward_give_transformers_forwards_logits(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    runner = _runner(build_model("llama", tmp_path / "llama"))
    lean = runner.loaded.lean
    assert isinstance(lean, LeanLlama)
    compared: list[int] = []

    def both(loaded: object, inputs: object, use_logits_to_keep: bool) -> torch.Tensor:
        # transformers first: the lean forward then rewrites the step's K/V, which later steps
        # read, so a difference in what it writes shows in the next comparison.
        runner.loaded.lean = None
        try:
            reference = compute_logits(runner.loaded, inputs, use_logits_to_keep)
        finally:
            runner.loaded.lean = lean
        got = compute_logits(runner.loaded, inputs, use_logits_to_keep)
        assert torch.equal(got, reference)
        compared.append(got.shape[0])
        return got

    monkeypatch.setattr(model_runner, "compute_logits", both)
    for plan in _plans():
        result = runner.execute(plan)
        assert not result.rejected
    # b samples once its second chunk is in.
    assert compared == [1, 2, 2, 2, 2, 2]


def test_only_a_fused_llama_takes_the_lean_forward(tmp_path: Path) -> None:
    assert _runner(build_model("qwen2", tmp_path / "qwen2")).loaded.lean is None
    llama = build_model("llama", tmp_path / "llama")
    assert _runner(llama, packed_linear=False).loaded.lean is None
    fused = _runner(llama).loaded.model
    layer = fused.model.layers[1]
    assert lean_llama(fused) is not None
    layer.mlp = torch.nn.Identity()
    assert lean_llama(fused) is None


def test_the_mlp_is_gated_in_the_gemm_where_the_panel_kernel_packs_it(tmp_path: Path) -> None:
    # The test model's intermediate width (128) is whole panels of 16.
    llama = build_model("llama", tmp_path / "llama")
    for panel_linear in (True, False):
        model = _runner(llama, panel_linear=panel_linear).loaded.model
        mlps = [m for m in model.modules() if isinstance(m, FusedMLP)]
        assert mlps and all(m.gated == (m.gate_up.panels is not None) for m in mlps)
        assert panel_linear or not any(m.gated for m in mlps)
