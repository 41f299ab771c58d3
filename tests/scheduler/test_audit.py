"""The block-accounting audit (Admin/Audit): clean after every step of random workloads through
preemption, prefix hits and aborts, and it names each mismatch injected on purpose."""

from dataclasses import replace

from hypothesis import given, settings
from hypothesis import strategies as st

from kv_manager.audit import pool_mismatches
from scheduler_service.core.audit import audit_executor
from scheduler_service.core.config import SchedulerConfig
from scheduler_service.core.request import Request
from scheduler_service.core.sampling_params import SamplingParams
from scheduler_service.core.scheduler import Scheduler
from scheduler_service.core.sim_executor import SimulatedExecutor
from scheduler_service.core.step_plan import HeldState


def audited_step(scheduler: Scheduler, executor: SimulatedExecutor) -> list[str]:
    plan = scheduler.schedule()
    plan.want_held_requests = True
    output = executor.execute(plan)
    scheduler.update(output)
    assert output.held_requests is not None
    return audit_executor(scheduler, output.held_requests)


_arrival = st.tuples(
    st.integers(0, 6),            # shared-prefix group (prefix hits)
    st.integers(1, 30),           # tail length
    st.integers(1, 12),           # max tokens
    st.booleans(),                # aborted midway
)


@settings(max_examples=40, deadline=None)
@given(arrivals=st.lists(_arrival, min_size=1, max_size=24), num_blocks=st.integers(16, 40))
def test_the_books_agree_after_every_step(arrivals: list[tuple[int, int, int, bool]], num_blocks: int) -> None:
    config = SchedulerConfig(num_kv_blocks=num_blocks, block_size=4, max_model_len=256, max_num_batched_tokens=32)
    scheduler = Scheduler(config)
    executor = SimulatedExecutor(num_blocks, 4)
    to_abort = []
    for index, (group, tail, max_tokens, abort) in enumerate(arrivals):
        prompt = [1000 + group] * 9 + list(range(index * 50, index * 50 + tail))
        request = Request(f"r{index}", prompt, SamplingParams(max_tokens=max_tokens, ignore_eos=True))
        scheduler.add_request(request)
        if abort:
            to_abort.append(request.request_id)
        assert audited_step(scheduler, executor) == []
    steps = 0
    while scheduler.has_unfinished():
        if to_abort and steps % 3 == 0:
            scheduler.abort(to_abort.pop())
        assert audited_step(scheduler, executor) == []
        steps += 1
        assert steps < 2000
    assert audited_step(scheduler, executor) == []
    assert scheduler.kv.num_free_blocks == num_blocks


def _running_pair() -> tuple[Scheduler, dict[str, HeldState]]:
    config = SchedulerConfig(num_kv_blocks=16, block_size=4, max_model_len=128)
    scheduler = Scheduler(config)
    executor = SimulatedExecutor(16, 4)
    for index in range(2):
        scheduler.add_request(Request(f"r{index}", list(range(index * 20, index * 20 + 9)), SamplingParams(max_tokens=20, ignore_eos=True)))
    plan = scheduler.schedule()
    plan.want_held_requests = True
    output = executor.execute(plan)
    scheduler.update(output)
    assert output.held_requests is not None and audit_executor(scheduler, output.held_requests) == []
    return scheduler, dict(output.held_requests)


def test_a_reference_count_off_by_one_is_found() -> None:
    scheduler, held = _running_pair()
    block = scheduler.kv.block_ids("r0")[0]
    scheduler.kv.pool.blocks[block].ref_count += 1
    (mismatch,) = audit_executor(scheduler, held)
    assert mismatch.startswith(f"block {block}: reference count 2, but 1 block tables name it ['r0']")


def test_a_freed_block_still_in_use_is_found() -> None:
    scheduler, _ = _running_pair()
    block = scheduler.kv.block_ids("r1")[-1]
    scheduler.kv.pool.blocks[block].ref_count = 0
    found = pool_mismatches(scheduler.kv)
    assert any(f"block {block}: reference count 0 yet not free" in line for line in found)


def test_executor_states_that_differ_are_named() -> None:
    scheduler, held = _running_pair()
    r0 = held.pop("r0")
    held["r1"] = replace(held["r1"], block_ids=held["r1"].block_ids[:-1])
    held["ghost"] = HeldState((3,), 4)
    held["r2"] = replace(r0, num_computed_tokens=r0.num_computed_tokens)
    found = audit_executor(scheduler, held)
    assert "request r0: placed on the executor, which does not hold it" in found
    assert any(line.startswith("request r1: block table") for line in found)
    assert "request ghost: held by the executor, which the scheduler never placed there" in found
    assert len(found) == 4


def test_a_computed_count_that_differs_is_named() -> None:
    scheduler, held = _running_pair()
    held["r0"] = replace(held["r0"], num_computed_tokens=held["r0"].num_computed_tokens - 1)
    (mismatch,) = audit_executor(scheduler, held)
    assert mismatch == "request r0: 8 tokens computed on the executor, 9 in the scheduler"
