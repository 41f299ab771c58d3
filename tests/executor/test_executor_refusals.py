"""A model the executor cannot run correctly is refused at start: the process exits non-zero,
before it reports ready, with one log line that names the model type and why, and no traceback.
"""

from __future__ import annotations

import json
import os
import subprocess
from pathlib import Path

import pytest

from tests.helpers.executor_process import executor_command
from tests.helpers.hybrid_models import save_hybrid
from tests.helpers.model_factory import build_model
from tests.helpers.service_process import REPO_ROOT

# A Llama whose embedding mixes each token with the one before it: state that lives outside
# attention, so a decode step (which sees one new token) cannot reproduce the full forward.
TOKEN_SHIFT_MODEL_CODE = '''
import torch
from torch import nn
from transformers import LlamaForCausalLM


class TokenShiftEmbedding(nn.Embedding):
    def forward(self, input_ids):
        embedded = super().forward(input_ids)
        previous = torch.cat([torch.zeros_like(embedded[:, :1]), embedded[:, :-1]], dim=1)
        return embedded + 0.5 * previous


class TokenShiftLlamaForCausalLM(LlamaForCausalLM):
    def __init__(self, config):
        super().__init__(config)
        embed = self.model.embed_tokens
        self.model.embed_tokens = TokenShiftEmbedding(
            embed.num_embeddings, embed.embedding_dim, embed.padding_idx
        )
'''

RUNNING_MEAN_MODEL_CODE = '''
import torch
from torch import nn
from transformers import LlamaForCausalLM


class RunningMean(nn.Module):
    def forward(self, hidden_states, **kwargs):
        counts = torch.arange(1, hidden_states.shape[1] + 1, device=hidden_states.device)
        return hidden_states.cumsum(1) / counts[None, :, None], None


class RunningMeanLlamaForCausalLM(LlamaForCausalLM):
    def __init__(self, config):
        super().__init__(config)
        self.model.layers[1].self_attn = RunningMean()
'''


def _start(model_dir: Path, tmp_path: Path, **flags: object) -> subprocess.CompletedProcess[str]:
    env_cache = {"HF_MODULES_CACHE": str(tmp_path / "hf_modules")}
    return subprocess.run(
        executor_command(model_dir, **flags),
        cwd=REPO_ROOT,
        capture_output=True,
        text=True,
        timeout=180,
        env={**os.environ, **env_cache},
    )


def _assert_refused(run: subprocess.CompletedProcess[str], model_type: str, reason: str) -> None:
    log = run.stdout + run.stderr
    assert run.returncode == 1, log
    refusals = [line for line in log.splitlines() if "event=executor_refused" in line]
    assert len(refusals) == 1, log
    assert f"model_type={model_type} " in refusals[0] and reason in refusals[0], refusals[0]
    assert "Traceback" not in log and "event=executor_ready" not in log


# bfloat16: its bound also scales with how far the model's own two attentions differ, and
# must still catch this.
@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_a_model_whose_forward_the_paged_path_cannot_reproduce_fails_the_self_check(
    tmp_path: Path, dtype: str
) -> None:
    model_dir = build_model("llama", tmp_path / "token_shift")
    (model_dir / "token_shift.py").write_text(TOKEN_SHIFT_MODEL_CODE)
    config = json.loads((model_dir / "config.json").read_text())
    config["auto_map"] = {"AutoModelForCausalLM": "token_shift.TokenShiftLlamaForCausalLM"}
    (model_dir / "config.json").write_text(json.dumps(config))
    run = _start(model_dir, tmp_path, trust_remote_code=True, dtype=dtype)
    _assert_refused(run, "llama", "does not reproduce the model's own forward")


def test_a_layer_that_mixes_tokens_outside_the_cache_interfaces_is_refused(tmp_path: Path) -> None:
    """A layer that mixes tokens with code of its own (no attention through AttentionInterface, no
    state through transformers' cache) keeps something per sequence that the executor cannot hold."""
    model_dir = build_model("llama", tmp_path / "running_mean")
    (model_dir / "running_mean.py").write_text(RUNNING_MEAN_MODEL_CODE)
    config = json.loads((model_dir / "config.json").read_text())
    config["auto_map"] = {"AutoModelForCausalLM": "running_mean.RunningMeanLlamaForCausalLM"}
    (model_dir / "config.json").write_text(json.dumps(config))
    run = _start(model_dir, tmp_path, trust_remote_code=True)
    _assert_refused(run, "llama", "1 of its 2 layers (first: layer 1) keep neither attention K/V nor recurrent state")


def test_a_backend_that_cannot_run_here_is_refused(tmp_path: Path) -> None:
    run = _start(build_model("llama", tmp_path / "llama"), tmp_path, attention_backend="flash_attn")
    log = run.stdout + run.stderr
    assert run.returncode == 1 and "Traceback" not in log
    assert "event=executor_refused reason='flash_attn needs CUDA" in log


def test_a_hybrid_model_under_tensor_parallelism_is_refused_with_why(tmp_path: Path) -> None:
    """Its recurrent layers would run replicated on every rank, which nothing checks yet."""
    run = _start(save_hybrid("qwen3_next", tmp_path / "qwen3_next"), tmp_path, tensor_parallel_size=2, threads=1, max_model_len=1024)
    log = run.stdout + run.stderr
    # 1, or 3 when the watcher of rank 1 sees it go before rank 0's refusal ends the process.
    assert run.returncode in (1, 3) and "Traceback" not in log, log
    refusals = [line for line in log.splitlines() if "event=executor_refused" in line]
    assert refusals and all("model_type=qwen3_next" in line and "not sharded over tensor-parallel ranks" in line for line in refusals)
    assert "event=executor_ready" not in log
