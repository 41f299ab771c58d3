"""A tier's front-end never loads torch (process/torch_free.py), real processes: it tokenizes
chats and streams their answers, and a grammar that cannot compile is still refused with
INVALID_ARGUMENT naming the problem (its planner compiles grammars), while the planner, which
loads its tokenizer the ordinary way, does hold torch: the probe tells the two apart."""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import ExitStack
from dataclasses import dataclass
from pathlib import Path

import pytest

from clients import Client
from clients.errors import SplitserveError
from protos.executor_access import write_token_file
from tests.helpers.service_process import ServiceProcess
from tests.helpers.sim_executor_process import start_sim_executor
from tests.helpers.tenant_stack import chat_tokenizer_dir
from tests.helpers.tier_processes import frontend, planner, wait_for


@dataclass(slots=True, frozen=True)
class Tier:
    planner: ServiceProcess
    frontend: ServiceProcess
    frontend_address: str


def maps_torch(process: ServiceProcess) -> bool:
    """Whether the process has torch's shared library mapped."""
    return "libtorch" in Path(f"/proc/{process.process.pid}/maps").read_text()


@pytest.fixture(scope="module")
def tier(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Tier]:
    folder = tmp_path_factory.mktemp("torch-free")
    tokenizer = chat_tokenizer_dir(folder / "tokenizer")
    token = folder / "planner-token"
    write_token_file(token)
    with ExitStack() as stack:
        executor = stack.enter_context(start_sim_executor(step_ms=5))
        the_planner = planner([executor], token, "--tokenizer", str(tokenizer))
        stack.callback(the_planner.close)
        planner_address = the_planner.wait_ready()
        wait_for(lambda: "state=up" in the_planner.log_text(), what="the planner holding its executor")
        front = frontend([planner_address], token, "--tokenizer", str(tokenizer))
        stack.callback(front.close)
        yield Tier(the_planner, front, front.wait_ready())


def test_a_frontend_serves_chats_without_torch(tier: Tier) -> None:
    assert not maps_torch(tier.frontend)
    with Client(tier.frontend_address) as client:
        answer = client.generate(messages=[{"role": "user", "content": "Say hello."}], max_tokens=6, temperature=0.0)
    assert len(answer.token_ids) == 6
    assert not maps_torch(tier.frontend)
    assert maps_torch(tier.planner)


def test_a_grammar_that_cannot_compile_is_refused_through_a_torch_free_frontend(tier: Tier) -> None:
    with Client(tier.frontend_address) as client, pytest.raises(SplitserveError) as refused:
        client.generate("The day is", max_tokens=4, structured_output={"regex": "(unclosed"})
    assert refused.value.code.name == "INVALID_ARGUMENT"
    assert "structured_output regex cannot be compiled: Regex parsing error" in str(refused.value)
    assert not maps_torch(tier.frontend)
