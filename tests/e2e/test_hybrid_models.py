"""Hybrid and state-space models (attention beside Mamba, Gated DeltaNet, short-convolution or
lightning-attention layers) through a real scheduler and executor: each request's recurrent state
lives in a state slot, carried across prefill chunks, updated by batched decodes, freed and
recomputed on preemption and on an executor's death, moved with its blocks on a drain. Every output is transformers' own greedy
`generate` of the same random model.

The whole family list runs under make test-slow; make test runs three that cover the three kinds
of recurrent layer the executor treats differently (a chunked Gated DeltaNet scan, a Mamba-1 scan
continued one token at a time, a short convolution)."""

from __future__ import annotations

import asyncio
from pathlib import Path

import grpc
import pytest
import torch

from clients import AsyncClient, Client
from protos.splitserve.v1 import admin_pb2, admin_pb2_grpc
from protos.splitserve.v1.generation_pb2 import EXECUTOR_STATE_UP
from tests.helpers.block_audit import assert_books_agree
from tests.helpers.executor_kill import stream_through_executor_kill
from tests.helpers.executor_process import ExecutorProcess, start_executor
from tests.helpers.greedy_client import generate_greedy, stream_all
from tests.helpers.greedy_reference import Reference
from tests.helpers.hybrid_models import HYBRID_TYPES, save_hybrid
from tests.helpers.metrics_scrape import scrape, total
from tests.helpers.scheduler_process import SchedulerProcess, start_scheduler
from tests.helpers.service_process import free_port

torch.set_num_threads(1)

# 8 prompts of 1 to 300 tokens; with 96 tokens a step the long ones are prefilled in chunks,
# each continuing the state the last one left, beside the short ones' decodes.
PROMPT_LENGTHS = (1, 3, 17, 40, 90, 160, 230, 300)
PROMPTS = [[(37 * i + 11 * n) % 990 + 5 for i in range(n)] for n in PROMPT_LENGTHS]
NEW_TOKENS = 8
STEP_TOKENS = 96
QUICK = ("qwen3_next", "jamba", "lfm2")


def _parity(model_type: str, folder: Path) -> None:
    save_hybrid(model_type, folder)
    reference = Reference(folder)
    expected = [reference(prompt, NEW_TOKENS) for prompt in PROMPTS]
    with start_executor(folder, num_kv_blocks=256, max_model_len=1024) as (executor, _):
        with start_scheduler(executor, max_num_batched_tokens=STEP_TOKENS) as scheduler:
            assert generate_greedy(scheduler, PROMPTS, NEW_TOKENS) == expected
            with Client(scheduler) as client:
                status = client.server_status()
    assert status.num_steps > len(PROMPTS)


@pytest.mark.parametrize("model_type", QUICK)
def test_a_hybrid_model_gives_transformers_greedy_tokens(model_type: str, tmp_path: Path) -> None:
    _parity(model_type, tmp_path / model_type)


@pytest.mark.slow
@pytest.mark.parametrize("model_type", [t for t in HYBRID_TYPES if t not in QUICK])
def test_every_hybrid_family_gives_transformers_greedy_tokens(model_type: str, tmp_path: Path) -> None:
    _parity(model_type, tmp_path / model_type)


@pytest.mark.parametrize("model_type", ["qwen3_next", "jamba"])
def test_requests_sharing_a_prefix_resume_from_its_recurrent_state(model_type: str, tmp_path: Path) -> None:
    """A 200-token prefix computed once: later requests that share it hit the prefix cache (its
    K/V blocks and the recurrent state kept at the last checkpoint inside it, 192 tokens with the
    default checkpoint every 4 blocks of 16) and still get exactly transformers' tokens."""
    folder = save_hybrid(model_type, tmp_path / model_type)
    reference = Reference(folder)
    prefix = [(29 * i) % 990 + 5 for i in range(200)]
    prompts = [prefix + [(41 * i + 97 * k) % 990 + 5 for i in range(5 + 7 * k)] for k in range(7)]
    with start_executor(folder, num_kv_blocks=256, block_size=16, max_model_len=1024) as (executor, _):
        with start_scheduler(executor) as scheduler:
            first = asyncio.run(_greedy_logprobs(scheduler, prompts[:1]))
            rest = asyncio.run(_greedy_logprobs(scheduler, prompts[1:]))
            with Client(scheduler) as client:
                status = client.server_status()
    # Tokens alone would hide a wrong state: a random model's recurrent layers forget fast, and
    # its attention layers see the whole context. Each token's logprob does not.
    for (tokens, logprobs), prompt in zip(first + rest, prompts, strict=True):
        assert tokens == reference(prompt, NEW_TOKENS)
        assert logprobs == pytest.approx(_reference_logprobs(reference, prompt, tokens), abs=2e-3)
    looked_up = sum(len(prompt) for prompt in prompts)
    # Six of the seven prompts resume after 192 tokens.
    assert status.prefix_cache_hit_rate == pytest.approx(6 * 192 / looked_up, abs=0.02)


async def _greedy_logprobs(address: str, prompts: list[list[int]]) -> list[tuple[list[int], list[float]]]:
    async with AsyncClient(address) as client:
        results = await asyncio.gather(
            *(
                client.generate(prompt_token_ids=prompt, max_tokens=NEW_TOKENS, temperature=0, ignore_eos=True, logprobs=0)
                for prompt in prompts
            )
        )
    return [(result.token_ids, [entry.logprob for entry in result.logprobs or []]) for result in results]


def _reference_logprobs(reference: Reference, prompt: list[int], tokens: list[int]) -> list[float]:
    """Each token's logprob under transformers' whole forward over the prompt and the tokens."""
    with torch.inference_mode():
        logits = reference.model(input_ids=torch.tensor([prompt + tokens]), use_cache=False).logits[0]
    logprobs = torch.log_softmax(logits[len(prompt) - 1 : -1].float(), dim=-1)
    return logprobs[torch.arange(len(tokens)), torch.tensor(tokens)].tolist()


def test_preempted_hybrid_requests_recompute_their_state_exactly(tmp_path: Path) -> None:
    """24 streams over a 48-block pool: requests are preempted (their slots freed) and recomputed
    from their tokens, and each still gets exactly the undisturbed tokens."""
    folder = save_hybrid("qwen3_next", tmp_path / "qwen3_next")
    reference = Reference(folder)
    jobs = [([(13 * i + 7 * k) % 990 + 5 for i in range(20 + 9 * k)], 24) for k in range(24)]
    with start_executor(folder, num_kv_blocks=48, block_size=16, max_model_len=1024) as (executor, _):
        with start_scheduler(executor) as scheduler:
            outputs = asyncio.run(stream_all(scheduler, jobs))
            with Client(scheduler) as client:
                status = client.server_status()
    assert status.num_preemptions >= 1
    for (prompt, max_tokens), output in zip(jobs, outputs, strict=True):
        assert output == reference(prompt, max_tokens)


def test_a_killed_hybrid_executor_loses_no_request_and_no_token(tmp_path: Path) -> None:
    """SIGKILL a qwen3_next executor while 10 streams run and start a fresh one on its address:
    the scheduler recomputes each request's state from the tokens already streamed."""
    folder = save_hybrid("qwen3_next", tmp_path / "qwen3_next")
    reference = Reference(folder)
    jobs = [([(17 * i + 5 * k) % 990 + 5 for i in range(10 + 23 * k)], 40) for k in range(10)]
    outputs, status = stream_through_executor_kill(folder, jobs, num_kv_blocks=256, block_size=16, max_model_len=1024)
    for (prompt, max_tokens), output in zip(jobs, outputs, strict=True):
        assert output == reference(prompt, max_tokens)
    assert status.executors[0].state == EXECUTOR_STATE_UP
    assert status.num_preemptions >= 1


@pytest.mark.parametrize("model_type", ["qwen3_next", "lfm2"])
def test_a_drain_moves_hybrid_requests_with_their_recurrent_state(model_type: str, tmp_path: Path) -> None:
    """Two executors, 8 streams; one is drained mid-generation: its running requests move to the
    other with their blocks and recurrent state, nothing is recomputed, and every token and its
    logprob is transformers' (a wrong state would show in the logprobs)."""
    folder = save_hybrid(model_type, tmp_path / model_type)
    reference = Reference(folder)
    prompts = [[(19 * i + 31 * k) % 990 + 5 for i in range(60 + 25 * k)] for k in range(8)]
    new_tokens = 32
    executors = [ExecutorProcess(folder, port=free_port(), num_kv_blocks=256, block_size=16, max_model_len=1024) for _ in range(2)]
    metrics_port = free_port()
    scheduler = None
    try:
        addresses = [executor.wait_ready() for executor in executors]
        scheduler = SchedulerProcess(addresses, metrics_port=metrics_port)
        address = scheduler.wait_ready()

        async def scenario() -> list[tuple[list[int], list[float]]]:
            async with AsyncClient(address) as client:
                while sum(e.state == EXECUTOR_STATE_UP for e in (await client.server_status()).executors) < 2:
                    await asyncio.sleep(0.02)
                streams = asyncio.gather(
                    *(
                        client.generate(prompt_token_ids=p, max_tokens=new_tokens, temperature=0, ignore_eos=True, logprobs=0)
                        for p in prompts
                    )
                )
                while (await client.server_status()).num_steps < 16:
                    await asyncio.sleep(0.01)
                async with grpc.aio.insecure_channel(address) as channel:
                    await admin_pb2_grpc.AdminStub(channel).DrainExecutor(admin_pb2.DrainExecutorRequest(address=addresses[0]))
                results = await streams
            return [(r.token_ids, [entry.logprob for entry in r.logprobs or []]) for r in results]

        outputs = asyncio.run(scenario())
        assert_books_agree(address)
        samples, _ = scrape(metrics_port)
    finally:
        if scheduler is not None:
            scheduler.close()
        for executor in executors:
            executor.close()
    for (tokens, logprobs), prompt in zip(outputs, prompts, strict=True):
        assert tokens == reference(prompt, new_tokens)
        assert logprobs == pytest.approx(_reference_logprobs(reference, prompt, tokens), abs=2e-3)
    assert samples['splitserve:kv_moves_total{outcome="ok"}'] > 0
    assert total(samples, "splitserve:recomputed_tokens_total") == 0
