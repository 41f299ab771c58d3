"""A request's tokens and logprobs (top 5 included) do not depend on its company: a probe gets
the same bits alone, among 31 concurrent requests of random lengths, with its prompt prefilled
32 tokens a step, and when its executor is killed mid-generation and a fresh one recomputes it;
a seeded sampled probe gets the same tokens each way too (DESIGN.md, "same bits whatever the
batch"). Floats are compared exactly, as hex."""

from __future__ import annotations

import asyncio
import random
from collections.abc import Callable
from pathlib import Path

import pytest

from clients import AsyncClient
from clients.results import GenerationResult
from tests.helpers.executor_process import ExecutorProcess
from tests.helpers.model_factory import VOCAB_SIZE, build_model
from tests.helpers.scheduler_process import start_scheduler
from tests.helpers.service_process import free_port

PROBE_TOKENS = 40
NEIGHBOURS = 31
# Steps the probe's executor runs before it is killed (the probe is then mid-generation).
STEPS_BEFORE_KILL = 15
EXECUTOR_FLAGS = {"num_kv_blocks": 512, "block_size": 16, "max_model_len": 512}

Fingerprint = list[tuple[int, str, list[str]]]


@pytest.fixture(
    scope="module",
    params=["random-llama", pytest.param("smollm2", marks=pytest.mark.slow)],
)
def model(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, int]:
    """The model folder and the range of token ids prompts are drawn from."""
    if request.param == "smollm2":
        return request.getfixturevalue("prepared_model"), 40_000
    return build_model("llama", tmp_path_factory.mktemp("same-bits") / "llama", seed=11), VOCAB_SIZE


def _fingerprint(result: GenerationResult) -> Fingerprint:
    assert result.logprobs is not None and len(result.logprobs) == PROBE_TOKENS
    return [(lp.token_id, lp.logprob.hex(), [t.hex() for t in lp.top_logprobs]) for lp in result.logprobs]


async def _run(address: str, vocab: int, neighbours: int, seeded: bool, kill: Callable[[], None] | None = None) -> Fingerprint:
    """The probe's fingerprint, sent beside `neighbours` greedy requests; `kill` (if given) is
    called once the executor has run STEPS_BEFORE_KILL steps with them all in flight."""
    rng = random.Random(7)
    prompt = [random.Random(1).randrange(5, vocab) for _ in range(21)]
    sampling = {"temperature": 0.8, "seed": 1234} if seeded else {"temperature": 0.0}
    async with AsyncClient(address) as client:
        others = [
            client.generate(
                prompt_token_ids=[rng.randrange(5, vocab) for _ in range(rng.randrange(3, 120))],
                max_tokens=rng.randrange(8, 60), temperature=0.0, ignore_eos=True,
            )
            for _ in range(neighbours)
        ]
        probe = asyncio.gather(
            client.generate(prompt_token_ids=prompt, max_tokens=PROBE_TOKENS, ignore_eos=True, logprobs=5, **sampling),
            *others,
        )
        if kill is not None:
            start = (await client.server_status()).num_steps
            while (await client.server_status()).num_steps < start + STEPS_BEFORE_KILL:
                await asyncio.sleep(0.01)
            kill()
        results = await probe
    return _fingerprint(results[0])


def _first_difference(expected: Fingerprint, got: Fingerprint) -> str:
    index = next(i for i, (a, b) in enumerate(zip(expected, got, strict=True)) if a != b)
    return f"token {index}: {expected[index][:2]} then {got[index][:2]}"


def test_a_probe_has_the_same_bits_alone_batched_chunked_and_after_its_executor_is_killed(
    model: tuple[Path, int],
) -> None:
    model_dir, vocab = model
    port = free_port()
    first = ExecutorProcess(model_dir, port=port, **EXECUTOR_FLAGS)
    replacement: ExecutorProcess | None = None

    def kill_and_restart() -> None:
        nonlocal replacement
        first.process.kill()
        first.process.wait()
        replacement = ExecutorProcess(model_dir, port=port, **EXECUTOR_FLAGS)

    try:
        executor = first.wait_ready()
        found: dict[str, dict[str, Fingerprint]] = {"greedy": {}, "seeded": {}}
        with start_scheduler(executor) as address:
            for kind, seeded in (("greedy", False), ("seeded", True)):
                found[kind]["alone"] = asyncio.run(_run(address, vocab, 0, seeded))
                found[kind][f"among {NEIGHBOURS} others"] = asyncio.run(_run(address, vocab, NEIGHBOURS, seeded))
        with start_scheduler(executor, max_num_batched_tokens=32) as address:
            for kind, seeded in (("greedy", False), ("seeded", True)):
                found[kind]["prefilled 32 tokens a step"] = asyncio.run(_run(address, vocab, NEIGHBOURS, seeded))
            for kind, seeded in (("greedy", False), ("seeded", True)):
                found[kind]["executor killed and restarted"] = asyncio.run(
                    _run(address, vocab, 7, seeded, kill_and_restart)
                )
                assert replacement is not None
                replacement.wait_ready()
                first, replacement = replacement, None
    finally:
        first.close()
        if replacement is not None:
            replacement.close()
    for kind, ways in found.items():
        alone = ways.pop("alone")
        for way, got in ways.items():
            assert got == alone, f"{kind} probe {way}: {_first_difference(alone, got)}"
