"""Sibling choices of one prompt (SamplingParams.n > 1) fork from one prompt computation: the
later choices share the first one's full blocks, copy its partial last block, compute only the
prompt's last token for their own first logits, and otherwise run like any request. The
simulated executor checks every slot a request attends over, so a choice reading a block that
another overwrote fails the run."""

from dataclasses import replace

from scheduler_service.core.config import SchedulerConfig
from scheduler_service.core.request import Request
from scheduler_service.core.sampling_params import SamplingParams
from tests.helpers.sched_harness import Run, run

CONFIG = SchedulerConfig(num_kv_blocks=64, block_size=4, max_model_len=256, block_copies=True)


def by_choice(request_id: str, token_ids: list[int]) -> int:
    """A stand-in model whose choices differ: the token depends on the request id, as each
    choice's own seed makes a sampled token depend on it."""
    return (sum(token_ids[-3:]) * 7 + len(token_ids) + 13 * sum(map(ord, request_id))) % 500 + 3


def choices(prompt: list[int], n: int, max_tokens: int = 6, group: str = "a") -> list[Request]:
    sampling = SamplingParams(max_tokens=max_tokens, ignore_eos=True)
    first = Request(group, list(prompt), sampling)
    return [first] + [Request(f"{group}#{i}", list(prompt), sampling, fork_of=group) for i in range(1, n)]


def prompt_tokens_computed(result: Run) -> dict[str, int]:
    """Tokens each request computed in the step that admitted it."""
    return {new.request_id: new.num_scheduled_tokens for plan in result.plans for new in plan.new_requests}


def test_choices_compute_the_prompt_once_and_copy_its_partial_block() -> None:
    result = run(CONFIG, {1: choices(list(range(1, 11)), 3)}, next_token=by_choice)
    assert prompt_tokens_computed(result) == {"a": 10, "a#1": 1, "a#2": 1}
    copies = [copy for plan in result.plans for copy in plan.block_copies]
    assert len(copies) == 2 and len({copy.destination for copy in copies}) == 2
    alone = run(replace(CONFIG, block_copies=False), {1: choices(list(range(1, 11)), 3)}, next_token=by_choice)
    assert result.outputs == alone.outputs
    assert len({tuple(tokens) for tokens in result.outputs.values()}) == 3, "the choices differ"
    assert result.scheduler.kv.num_free_blocks == CONFIG.num_kv_blocks


def test_a_prompt_ending_on_a_block_boundary_forks_without_a_copy() -> None:
    result = run(CONFIG, {1: choices(list(range(1, 10)), 2)}, next_token=by_choice)
    assert prompt_tokens_computed(result) == {"a": 9, "a#1": 1}
    assert not any(plan.block_copies for plan in result.plans)


def test_choices_wait_for_a_chunked_prompt_then_fork() -> None:
    config = replace(CONFIG, max_num_batched_tokens=4)
    result = run(config, {1: choices(list(range(1, 15)), 3)}, next_token=by_choice)
    assert prompt_tokens_computed(result) == {"a": 4, "a#1": 1, "a#2": 1}
    alone = run(replace(config, block_copies=False), {1: choices(list(range(1, 15)), 3)}, next_token=by_choice)
    assert result.outputs == alone.outputs


def test_without_executor_support_or_once_the_first_choice_ended_choices_compute_their_own() -> None:
    plain = run(replace(CONFIG, block_copies=False), {1: choices(list(range(1, 11)), 2)}, next_token=by_choice)
    assert not any(plan.block_copies for plan in plain.plans)
    assert prompt_tokens_computed(plain)["a#1"] > 1
    first, second = choices(list(range(1, 11)), 2, max_tokens=1)
    late = run(CONFIG, {1: [first], 5: [second]}, next_token=by_choice)
    assert prompt_tokens_computed(late)["a#1"] > 1
    assert late.outputs["a#1"] == plain.outputs["a#1"][:1]


def test_forked_choices_survive_preemption_in_a_small_pool() -> None:
    config = replace(CONFIG, num_kv_blocks=14, max_num_batched_tokens=16)
    groups = [choices([g * 50 + t for t in range(1, 8 + g)], 3, max_tokens=10, group=f"g{g}") for g in range(4)]
    arrivals = {1 + g: group for g, group in enumerate(groups)}
    result = run(config, arrivals, next_token=by_choice)
    assert result.scheduler.num_preemptions > 0
    assert any(plan.block_copies for plan in result.plans)
    fresh = [choices([g * 50 + t for t in range(1, 8 + g)], 3, max_tokens=10, group=f"g{g}") for g in range(4)]
    alone = run(replace(config, block_copies=False), {1 + g: group for g, group in enumerate(fresh)}, next_token=by_choice)
    assert result.outputs == alone.outputs and not result.errors
    assert all(len(tokens) == 10 for tokens in result.outputs.values())
    assert result.scheduler.kv.num_free_blocks == config.num_kv_blocks
