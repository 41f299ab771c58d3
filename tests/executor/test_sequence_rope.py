"""Every rope type transformers ships gives each request the rotation transformers' generate gives
it alone: a short request batched beside a long one, prompts chunked or whole, keeps the greedy
tokens of its own generate. For the length-dependent types (longrope, dynamic) the executor picks
the frequencies per sequence (executor_service/model/sequence_rope.py); a flattened step would
otherwise make them depend on the longest sequence in it."""

from __future__ import annotations

import math
from pathlib import Path

import pytest
import torch
from transformers import AutoModelForCausalLM

from executor_service.model.sequence_rope import token_lengths
from executor_service.serving.settings import ExecutorSettings
from executor_service.startup import startup
from protos.splitserve.executor.v1 import executor_pb2 as pb
from tests.helpers.model_factory import build_model

BLOCK_SIZE = 8
HEAD_DIM = 16
# The length the long-context factors start at, short enough for a test's prompts to pass it.
ORIGINAL_MAX = 32
ROPE_TYPES: dict[str, dict[str, object]] = {
    "default": {"rope_type": "default"},
    "linear": {"rope_type": "linear", "factor": 2.0},
    "dynamic": {"rope_type": "dynamic", "factor": 2.0},
    "yarn": {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": ORIGINAL_MAX},
    "llama3": {
        "rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
        "original_max_position_embeddings": ORIGINAL_MAX,
    },
    "longrope": {
        "rope_type": "longrope",
        "short_factor": [1.0 + 0.1 * i for i in range(HEAD_DIM // 2)],
        "long_factor": [2.0 + 0.5 * i for i in range(HEAD_DIM // 2)],
        "original_max_position_embeddings": ORIGINAL_MAX,
    },
}
# (prompt length, tokens to generate): the short one crosses ORIGINAL_MAX while decoding, the
# long one starts past it.
REQUESTS = {"short": (6, 34), "long": (60, 8)}


def build(tmp_path: Path, rope_type: str) -> Path:
    # dynamic scales past max_position_embeddings: the executor serves up to factor times it
    # (64 here), so the requests cross the original length as the others' do.
    max_positions = ORIGINAL_MAX if rope_type == "dynamic" else 128
    return build_model(
        "llama", tmp_path / rope_type, seed=5, max_position_embeddings=max_positions,
        rope_parameters={"rope_theta": 10000.0, **ROPE_TYPES[rope_type]},
    )


def prompts() -> dict[str, list[int]]:
    generator = torch.Generator().manual_seed(11)
    return {
        name: torch.randint(3, 1000, (length,), generator=generator).tolist()
        for name, (length, _) in REQUESTS.items()
    }


def alone(model_dir: Path, prompt: list[int], max_tokens: int) -> list[int]:
    """transformers' greedy generate of one request, on a model of its own (dynamic's table
    keeps state between calls)."""
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    with torch.inference_mode():
        out = model.generate(
            torch.tensor([prompt]), max_new_tokens=max_tokens, do_sample=False, pad_token_id=0,
            eos_token_id=None,
        )
    return out[0, len(prompt) :].tolist()


def served_together(model_dir: Path, requests: dict[str, list[int]], chunk: int | None) -> dict[str, list[int]]:
    """Every request in the same steps of one in-process executor, prompts in chunks of `chunk`
    tokens (None: whole), until each has its tokens."""
    settings = ExecutorSettings(
        model_dir=model_dir, device="cpu", num_kv_blocks=64, block_size=BLOCK_SIZE, max_model_len=128
    )
    runner = startup.build_executor(settings).runner
    blocks = iter(range(64))
    outputs: dict[str, list[int]] = {name: [] for name in requests}
    computed = dict.fromkeys(requests, 0)
    step_id = 0
    while any(len(outputs[name]) < REQUESTS[name][1] for name in requests):
        step_id += 1
        plan = pb.StepPlan(step_id=step_id)
        for name, prompt in requests.items():
            if len(outputs[name]) >= REQUESTS[name][1]:
                continue
            left = len(prompt) - computed[name]
            count = 1 if left <= 0 else min(left, chunk or left)
            if computed[name] == 0:
                total = len(prompt) + REQUESTS[name][1]
                plan.new_requests.append(
                    pb.NewRequest(
                        request_id=name, token_ids=prompt, num_scheduled_tokens=count,
                        block_ids=[next(blocks) for _ in range(math.ceil(total / BLOCK_SIZE))],
                        sampling=pb.SamplerConfig(),
                    )
                )
            else:
                plan.continuing_requests.append(pb.ContinuingRequest(request_id=name, num_scheduled_tokens=count))
            computed[name] += count
        for output in runner.execute(plan).outputs:
            outputs[output.request_id].extend(output.token_ids)
    return outputs


def test_token_lengths_are_the_prompt_in_the_prefill_and_position_plus_one_after() -> None:
    assert token_lengths(6, 0, 6) == [6] * 6
    assert token_lengths(6, 4, 9) == [6, 6, 7, 8, 9]
    assert token_lengths(6, 10, 11) == [11]


@pytest.mark.parametrize("rope_type", list(ROPE_TYPES))
@pytest.mark.parametrize("chunk", [None, 7], ids=["whole", "chunked"])
def test_a_request_keeps_its_own_rotation_beside_a_longer_one(tmp_path: Path, rope_type: str, chunk: int | None) -> None:
    model_dir = build(tmp_path, rope_type)
    requests = prompts()
    if rope_type == "dynamic":
        requests["long"] = requests["long"][:50]
    served = served_together(model_dir, requests, chunk)
    for name, prompt in requests.items():
        assert served[name] == alone(model_dir, prompt, REQUESTS[name][1]), (rope_type, name)
