"""Sampling through a real executor: seeds independent of the batch, logprobs of the raw model."""

from __future__ import annotations

import random
from collections.abc import Iterator
from pathlib import Path

import grpc
import pytest
import torch
from transformers import AutoModelForCausalLM

from protos.splitserve.executor.v1 import executor_pb2 as pb
from tests.helpers.executor_driver import (
    BlockAllocator,
    Driver,
    PlannedRequest,
    PlanStream,
)
from tests.helpers.executor_process import executor_channel
from tests.helpers.model_factory import build_model

BLOCK_SIZE = 16
NUM_BLOCKS = 512
NEW_TOKENS = 24

torch.set_num_threads(1)


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return build_model("llama", tmp_path_factory.mktemp("llama"))


@pytest.fixture(scope="module")
def channel(model_dir: Path) -> Iterator[grpc.Channel]:
    with executor_channel(model_dir, num_kv_blocks=NUM_BLOCKS, block_size=BLOCK_SIZE) as channel:
        yield channel


@pytest.fixture
def driver(channel: grpc.Channel) -> Iterator[Driver]:
    stream = PlanStream(channel)
    yield Driver(stream, BLOCK_SIZE, BlockAllocator(NUM_BLOCKS))
    stream.close()


PROMPT = [random.Random(5).randrange(3, 1024) for _ in range(50)]


def seeded(request_id: str, seed: int) -> PlannedRequest:
    sampling = pb.SamplerConfig(temperature=1.0, top_p=0.95, has_seed=True, seed=seed)
    return PlannedRequest(request_id, list(PROMPT), NEW_TOKENS, sampling=sampling)


def crowd(count: int) -> list[PlannedRequest]:
    """Requests with every kind of sampling setting, and prompts of varied length."""
    rng = random.Random(9)
    settings = [
        pb.SamplerConfig(),
        pb.SamplerConfig(temperature=0.8),
        pb.SamplerConfig(temperature=1.2, top_k=20, has_seed=True, seed=77),
        pb.SamplerConfig(temperature=0.9, min_p=0.1, frequency_penalty=0.5),
        pb.SamplerConfig(
            temperature=1.0, repetition_penalty=1.3, want_logprobs=True, num_logprobs=3
        ),
        pb.SamplerConfig(temperature=0.7, top_p=0.8, presence_penalty=1.0),
    ]
    return [
        PlannedRequest(
            f"crowd{i}",
            [rng.randrange(3, 1024) for _ in range(rng.randrange(1, 120))],
            NEW_TOKENS - i % 5,
            sampling=settings[i % len(settings)],
            chunk_size=rng.choice([None, 7, 32]),
        )
        for i in range(count)
    ]


def test_seed_gives_the_same_tokens_alone_and_in_a_batch(driver: Driver) -> None:
    alone = seeded("alone", seed=1234)
    driver.run([alone])
    others = crowd(16)
    in_batch = seeded("in-batch", seed=1234)
    # Chunking the prefill differently changes nothing: draws happen only when a token is due.
    in_batch.chunk_size = 20
    driver.run(others[:7] + [in_batch] + others[7:])
    assert len(alone.output) == NEW_TOKENS
    assert in_batch.output == alone.output
    other_seed = seeded("other-seed", seed=4321)
    driver.run([other_seed])
    assert other_seed.output != alone.output


def test_logprobs_match_the_reference_model(driver: Driver, model_dir: Path) -> None:
    sampling = pb.SamplerConfig(want_logprobs=True, num_logprobs=5)
    request = PlannedRequest("logprobs", list(PROMPT), 1, sampling=sampling)
    plan = driver.plan([request])
    result = driver.stream.step(plan)
    (output,) = result.outputs
    (logprob,) = output.logprobs
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    with torch.inference_mode():
        logits = model(torch.tensor([PROMPT])).logits[0, -1]
    want = torch.log_softmax(logits, dim=-1).topk(5)
    assert logprob.token_id == output.token_ids[0] == want.indices[0].item()
    assert list(logprob.top_token_ids) == want.indices.tolist()
    assert list(logprob.top_logprobs) == pytest.approx(want.values.tolist(), abs=1e-4)
    assert logprob.logprob == pytest.approx(want.values[0].item(), abs=1e-4)


def test_seeded_request_survives_drop_and_recompute(driver: Driver) -> None:
    uninterrupted = seeded("whole", seed=99)
    driver.run([uninterrupted])
    interrupted = seeded("interrupted", seed=99)
    for _ in range(10):
        driver.apply(driver.stream.step(driver.plan([interrupted])), [interrupted])
    driver.preempt(interrupted)
    driver.run([interrupted])
    assert interrupted.output == uninterrupted.output
