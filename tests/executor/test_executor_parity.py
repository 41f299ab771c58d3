"""Greedy tokens of a real executor process equal transformers' generate, per architecture.

One executor process per architecture (module-scoped), driven over gRPC with plans, then through a
real scheduler process in front of it; the reference model runs in this process. The
architectures (tests/helpers/model_factory.py) cover sliding windows, soft-capping, attention sinks,
multi-query and latent attention, mixtures of experts, and decoder layers that do not pass
keyword arguments on to attention.
"""

from __future__ import annotations

import random
from collections.abc import Iterator
from pathlib import Path

import grpc
import pytest
import torch
from transformers import AutoModelForCausalLM, PreTrainedModel

from protos.splitserve.executor.v1 import executor_pb2 as pb
from tests.helpers.executor_driver import (
    BlockAllocator,
    Driver,
    PlannedRequest,
    PlanStream,
)
from tests.helpers.executor_process import ExecutorProcess
from tests.helpers.executor_token import with_token
from tests.helpers.greedy_client import generate_greedy
from tests.helpers.model_factory import ARCHITECTURES, build_model
from tests.helpers.scheduler_process import start_scheduler

BLOCK_SIZE = 16
NUM_BLOCKS = 1024
NEW_TOKENS = 32
PROMPT_LENGTHS = (1, 9, 33, 47, 64, 97, 128, 150, 220, 300)
SHARED_TOKENS = 2 * BLOCK_SIZE

torch.set_num_threads(1)


class Reference:
    """transformers generate (greedy, EOS ignored), memoised per prompt.

    Prompts are generated as one left-padded batch per call, since each generate call costs far
    more in per-step overhead than in arithmetic on these tiny models.
    """

    def __init__(self, model: PreTrainedModel) -> None:
        self.model = model
        self.cache: dict[tuple[int, ...], list[int]] = {}

    def __call__(self, prompt: list[int]) -> list[int]:
        self.prepare([prompt])
        return self.cache[tuple(prompt)]

    def prepare(self, prompts: list[list[int]]) -> None:
        todo = list({tuple(p) for p in prompts} - self.cache.keys())
        if not todo:
            return
        width = max(len(p) for p in todo)
        pad = self.model.generation_config.pad_token_id
        input_ids = torch.tensor([[pad] * (width - len(p)) + list(p) for p in todo])
        attention_mask = torch.tensor([[0] * (width - len(p)) + [1] * len(p) for p in todo])
        with torch.inference_mode():
            out = self.model.generate(
                input_ids,
                attention_mask=attention_mask,
                max_new_tokens=NEW_TOKENS,
                do_sample=False,
            )
        for prompt, row in zip(todo, out[:, width:].tolist(), strict=True):
            self.cache[prompt] = row


@pytest.fixture(scope="module", params=ARCHITECTURES)
def arch(request: pytest.FixtureRequest) -> str:
    return request.param


class Executors:
    """One executor process per architecture; the next one starts while the current one is
    tested, so start-up overlaps work without every process competing at once."""

    def __init__(self, model_dirs: dict[str, Path]) -> None:
        self.model_dirs = model_dirs
        self.processes: dict[str, ExecutorProcess] = {}

    def launch(self, arch: str) -> ExecutorProcess:
        if arch not in self.processes:
            self.processes[arch] = ExecutorProcess(
                self.model_dirs[arch], num_kv_blocks=NUM_BLOCKS, block_size=BLOCK_SIZE
            )
        return self.processes[arch]

    def ready(self, arch: str) -> ExecutorProcess:
        executor = self.launch(arch)
        executor.wait_ready()
        following = ARCHITECTURES.index(arch) + 1
        if following < len(ARCHITECTURES):
            self.launch(ARCHITECTURES[following])
        return executor

    def close(self) -> None:
        for executor in self.processes.values():
            executor.close()


@pytest.fixture(scope="module")
def executors(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Executors]:
    model_dirs = {a: build_model(a, tmp_path_factory.mktemp(a)) for a in ARCHITECTURES}
    executors = Executors(model_dirs)
    yield executors
    executors.close()


@pytest.fixture(scope="module")
def model_dir(arch: str, executors: Executors) -> Path:
    return executors.model_dirs[arch]


@pytest.fixture(scope="module")
def reference(model_dir: Path) -> Reference:
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    # generate would stop at EOS; the executor leaves stopping to the scheduler.
    model.generation_config.eos_token_id = None
    return Reference(model.eval())


@pytest.fixture(scope="module")
def executor_address(arch: str, executors: Executors) -> Iterator[str]:
    executor = executors.ready(arch)
    yield executor.wait_ready()
    # Its work is done; stopping it now frees memory for the architectures still to come.
    assert executor.stop() == 0


@pytest.fixture(scope="module")
def channel(executor_address: str) -> Iterator[grpc.Channel]:
    with grpc.insecure_channel(executor_address) as channel:
        yield with_token(channel)


@pytest.fixture
def driver(channel: grpc.Channel) -> Iterator[Driver]:
    stream = PlanStream(channel)
    yield Driver(stream, BLOCK_SIZE, BlockAllocator(NUM_BLOCKS))
    stream.close()


def make_prompts(seed: int, vocab: int = 1024) -> list[list[int]]:
    rng = random.Random(seed)
    # Ids 0-2 are pad/BOS/EOS in the factory's models; prompts avoid them.
    return [[rng.randrange(3, vocab) for _ in range(n)] for n in PROMPT_LENGTHS]


def requests_for(prompts: list[list[int]], **fields: object) -> list[PlannedRequest]:
    return [PlannedRequest(f"r{i}", p, NEW_TOKENS, **fields) for i, p in enumerate(prompts)]


def assert_matches(requests: list[PlannedRequest], reference: Reference) -> None:
    reference.prepare([r.prompt for r in requests])
    for req in requests:
        assert req.output == reference(req.prompt), f"{req.request_id} ({len(req.prompt)} tokens)"


def test_batch_pipelined(driver: Driver, reference: Reference) -> None:
    """All prompts in one batch; every decode plan is sent before the first result arrives."""
    requests = requests_for(make_prompts(1))
    driver.run_pipelined(requests)
    assert_matches(requests, reference)


def test_chunked_prefill(driver: Driver, reference: Reference) -> None:
    """Each prompt is prefilled in 3 chunks; short ones decode alongside longer ones' chunks."""
    prompts = make_prompts(2)
    requests = [
        PlannedRequest(f"c{i}", p, NEW_TOKENS, chunk_size=-(-len(p) // 3) + i % 2)
        for i, p in enumerate(prompts)
    ]
    driver.run(requests)
    assert_matches(requests, reference)


def test_prefix_blocks_shared(driver: Driver, reference: Reference) -> None:
    """Requests start from another request's first 2 cached blocks (num_computed = 2 blocks)."""
    rng = random.Random(3)
    owners = [
        PlannedRequest(f"owner{i}", p, NEW_TOKENS, keep_blocks=2)
        for i, p in enumerate(make_prompts(3))
        if len(p) > SHARED_TOKENS
    ]
    assert len(owners) >= 8
    driver.run(owners)
    sharers = [
        PlannedRequest(
            f"sharer{i}",
            owner.prompt[:SHARED_TOKENS] + [rng.randrange(3, 1024) for _ in range(1 + 13 * i)],
            NEW_TOKENS,
            cached_blocks=owner.blocks[:2],
        )
        for i, owner in enumerate(owners)
    ]
    driver.run(sharers)
    assert_matches(owners, reference)
    assert_matches(sharers, reference)


def test_drop_and_recompute(driver: Driver, reference: Reference) -> None:
    """Half the requests are dropped mid-generation and resent with prompt + generated tokens."""
    requests = requests_for(make_prompts(4))
    prompts = {r.request_id: list(r.prompt) for r in requests}
    for step in range(12):
        driver.apply(driver.stream.step(driver.plan(requests)), requests)
        if step == 8:
            for req in requests[::2]:
                driver.preempt(req)
    driver.run(requests)
    reference.prepare(list(prompts.values()))
    for req in requests:
        assert req.output == reference(prompts[req.request_id]), req.request_id


def test_through_the_scheduler(executor_address: str, reference: Reference) -> None:
    """Concurrent client requests through a scheduler process whose small token budget chunks
    the long prompts beside the short ones' decodes (it takes the executor over from the
    driver of the tests above)."""
    prompts = make_prompts(5)
    with start_scheduler(executor_address, max_num_batched_tokens=64) as address:
        outputs = generate_greedy(address, prompts, NEW_TOKENS)
    reference.prepare(prompts)
    for prompt, output in zip(prompts, outputs, strict=True):
        assert output == reference(prompt), f"prompt of {len(prompt)} tokens"


def test_a_sequence_has_the_same_logprobs_alone_batched_chunked_and_recomputed(
    arch: str, driver: Driver
) -> None:
    """The probe's greedy tokens and top-5 logprobs, bit for bit: alone; in the same steps as 7
    other requests; prefilled in chunks of 1, 7 and 32 tokens; and its decoded positions
    recomputed by a prefill (as after failover or preemption). The executor's logits are then a
    function of a sequence's own tokens only (DESIGN.md, "same bits whatever the batch")."""
    rng = random.Random(6)
    prompt = [rng.randrange(3, 1024) for _ in range(40)]
    sampling = pb.SamplerConfig(want_logprobs=True, num_logprobs=5)

    def probe(name: str, tokens: list[int], new: int, chunk: int | None = None) -> PlannedRequest:
        return PlannedRequest(name, tokens, new, sampling=sampling, chunk_size=chunk)

    alone = driver.run_logprobs([probe("alone", prompt, 6)])["alone"]
    assert len(alone) == 6
    others = [PlannedRequest(f"other{i}", [rng.randrange(3, 1024) for _ in range(rng.randrange(1, 90))], 8)
              for i in range(7)]
    ways = {"beside 7 others": driver.run_logprobs([probe("batched", prompt, 6), *others])["batched"]}
    for chunk in (1, 7, 32):
        ways[f"prefilled {chunk} tokens a step"] = driver.run_logprobs([probe(f"chunk{chunk}", prompt, 6, chunk)])[f"chunk{chunk}"]
    generated = [token for token, *_ in alone]
    recomputed = driver.run_logprobs([probe("recomputed", prompt + generated[:3], 3)])["recomputed"]
    ways["decoded positions recomputed"] = alone[:3] + recomputed
    differ = {
        way: next(i for i, (a, b) in enumerate(zip(alone, got, strict=True)) if a != b)
        for way, got in ways.items()
        if got != alone
    }
    assert not differ, f"logprobs differ from the probe's alone (way: first token that differs): {differ}"
