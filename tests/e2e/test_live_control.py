"""The scheduling knobs turned through the Admin API on a running scheduler, through real
processes: a policy switch under load orders the waiting requests anew from the next step, the
status reports the knobs in force, and a bad value is refused with INVALID_ARGUMENT."""

from __future__ import annotations

import asyncio
from collections.abc import Iterator
from pathlib import Path

import grpc
import pytest
import torch

from clients import AsyncClient, Client
from protos.splitserve.v1 import admin_pb2, admin_pb2_grpc
from tests.helpers.executor_process import start_executor
from tests.helpers.greedy_reference import Reference
from tests.helpers.model_factory import build_model
from tests.helpers.scheduler_process import start_scheduler

torch.set_num_threads(1)


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return build_model("llama", tmp_path_factory.mktemp("live") / "llama", seed=21)


@pytest.fixture(scope="module")
def executor(model_dir: Path) -> Iterator[str]:
    with start_executor(model_dir, num_kv_blocks=128, block_size=16) as (address, _):
        yield address


def _admin(address: str) -> admin_pb2_grpc.AdminStub:
    return admin_pb2_grpc.AdminStub(grpc.insecure_channel(address))


A_TOKENS = 600


def test_a_policy_switch_under_load_orders_the_waiting_requests_anew(executor: str, model_dir: Path) -> None:
    reference = Reference(model_dir)
    prompts = {name: [10 + index, 20, 30, 40 + index] for index, name in enumerate("abcd")}
    priorities = {"b": 5, "c": 1, "d": 3}

    async def scenario(address: str) -> tuple[list[str], dict[str, list[int]]]:
        started: list[str] = []
        outputs: dict[str, list[int]] = {}
        async with AsyncClient(address) as client:

            async def one(name: str, max_tokens: int, first_token: asyncio.Event) -> None:
                tokens: list[int] = []
                async for delta in client.stream(
                    prompt_token_ids=prompts[name], max_tokens=max_tokens, temperature=0,
                    ignore_eos=True, priority=priorities.get(name, 0),
                ):
                    if not tokens:
                        started.append(name)
                        first_token.set()
                    tokens.extend(delta.token_ids)
                outputs[name] = tokens

            running = asyncio.Event()
            # Long enough to outlast the queueing of the others on a fast host.
            tasks = [asyncio.create_task(one("a", A_TOKENS, running))]
            await running.wait()
            # Queued FCFS behind a: b, c, d; one request runs at a time.
            for name in "bcd":
                tasks.append(asyncio.create_task(one(name, 4, asyncio.Event())))
                while (await client.server_status()).num_waiting < len(tasks) - 1:
                    assert not tasks[0].done(), "a ended before b, c and d were queued behind it"
                    await asyncio.sleep(0.01)
            assert started == ["a"], "a was meant to be still running"
            applied = _admin(address).UpdateSchedulingConfig(admin_pb2.UpdateSchedulingConfigRequest(policy="priority"))
            assert applied.policy == "priority" and applied.max_num_seqs == 1
            await asyncio.gather(*tasks)
        return started, outputs

    with start_scheduler(executor, max_num_seqs=1, policy="fcfs") as address:
        started, outputs = asyncio.run(scenario(address))
        with Client(address) as client:
            status = client.server_status()
    assert started == ["a", "c", "d", "b"]
    assert status.policy == "priority"
    for name, tokens in outputs.items():
        assert tokens == reference(prompts[name], len(tokens))


def test_knobs_read_back_and_bad_values_are_refused(executor: str) -> None:
    with start_scheduler(executor, max_num_batched_tokens=512, mode="mixed") as address:
        admin = _admin(address)
        before = admin.GetSchedulingConfig(admin_pb2.GetSchedulingConfigRequest())
        assert (before.policy, before.mode, before.max_num_batched_tokens) == ("fcfs", "mixed", 512)
        after = admin.UpdateSchedulingConfig(
            admin_pb2.UpdateSchedulingConfigRequest(mode="decode-first", max_num_batched_tokens=64)
        )
        assert (after.policy, after.mode, after.max_num_batched_tokens, after.max_num_seqs) == (
            "fcfs", "decode-first", 64, before.max_num_seqs,
        )
        with pytest.raises(grpc.RpcError) as refused:
            admin.UpdateSchedulingConfig(admin_pb2.UpdateSchedulingConfigRequest(policy="lifo"))
        assert refused.value.code() == grpc.StatusCode.INVALID_ARGUMENT
        assert "policy 'lifo' is not one of fcfs, priority" in refused.value.details()
        with pytest.raises(grpc.RpcError) as refused:
            admin.UpdateSchedulingConfig(admin_pb2.UpdateSchedulingConfigRequest(max_num_seqs=0))
        assert refused.value.code() == grpc.StatusCode.INVALID_ARGUMENT
        # Nothing of a refused update is applied.
        assert admin.GetSchedulingConfig(admin_pb2.GetSchedulingConfigRequest()) == after
        with Client(address) as client:
            assert client.server_status().mode == "decode-first"
