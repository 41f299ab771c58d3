"""The blocks of drafts, as a property over random workloads: blocks are allocated for every
position a step computes; the rejected drafts' blocks stay the request's (the executor's table
keeps them too, and the request's next tokens overwrite their K/V) and are never more than its
drafts reached; only blocks of computed, accepted tokens enter the prefix cache, so a later
request that hits them reads exactly its tokens (the simulated executor checks every cached
slot); and every block is back in the pool at the end. With preemption, a host tier, aborts and
pipelined plans."""

from __future__ import annotations

from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from kv_manager import prefix_hash
from scheduler_service.core.audit import audit_executor
from scheduler_service.core.config import SchedulerConfig
from scheduler_service.core.errors import RequestRejected
from scheduler_service.core.request import FinishReason, Request
from scheduler_service.core.sampling_params import SamplingParams
from scheduler_service.core.scheduler import Scheduler
from scheduler_service.core.sim_executor import SimulatedExecutor
from tests.helpers.speculation_models import babble, decode_one_at_a_time, echo


def _check_blocks(scheduler: Scheduler, max_k: int) -> None:
    """Between plans, with none on the wire: each running request holds no block past what its
    computed tokens and its drafts reached, and each block it has entered in the prefix cache
    is a full block of computed tokens under their hash."""
    block_size = scheduler.config.block_size
    for request in scheduler.running:
        computed = request.num_computed_tokens
        held = len(scheduler.kv.block_ids(request.request_id))
        assert held <= -(-(computed + 1 + max_k) // block_size), request.request_id
        hashes = prefix_hash.chain_hashes(request.token_ids[:computed], block_size, request.cache_salt)
        for index in range(held):
            registered = scheduler.kv.registered_hash(request.request_id, index)
            if registered is not None:
                assert (index + 1) * block_size <= computed and registered == hashes[index]


@settings(max_examples=300, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(
    specs=st.lists(st.tuples(st.integers(2, 30), st.integers(1, 40), st.integers(0, 3)), min_size=1, max_size=6),
    num_blocks=st.integers(12, 48),
    block_size=st.sampled_from([1, 2, 4, 8]),
    budget=st.integers(4, 48),
    max_k=st.integers(1, 6),
    pipelined=st.booleans(),
    num_host_blocks=st.sampled_from([0, 16]),
    acceptance=st.sampled_from(["echo", "babble"]),
    aborts=st.sets(st.integers(0, 5), max_size=2),
    follow_ups=st.integers(0, 3),
)
def test_blocks_of_drafts_stay_accounted_and_only_accepted_tokens_are_cached(
    specs, num_blocks, block_size, budget, max_k, pipelined, num_host_blocks, acceptance, aborts, follow_ups,
) -> None:
    model = echo(6, every=5) if acceptance == "echo" else babble(3)
    config = SchedulerConfig(
        num_kv_blocks=num_blocks, block_size=block_size, max_model_len=256, max_num_batched_tokens=budget,
        max_num_seqs=4, num_speculative_tokens=max_k, num_host_blocks=num_host_blocks,
    )
    scheduler = Scheduler(config)
    executor = SimulatedExecutor(num_blocks, block_size, model)
    requests: list[Request] = []

    def add(request: Request) -> None:
        try:
            scheduler.add_request(request)
            requests.append(request)
        except RequestRejected:
            assert request.num_prompt_tokens >= config.max_seq_len

    for index, (prompt_len, max_tokens, stem) in enumerate(specs):
        # Shared stems for prefix hits; a repeated phrase for drafts to follow.
        prompt = ([stem, 1, 2] * 4 + [index, 9, index + 1] * 4)[:prompt_len]
        add(Request(f"q{index}", prompt, SamplingParams(max_tokens=max_tokens, ignore_eos=True)))
    in_flight = []
    for step in range(3000):
        if not scheduler.has_unfinished():
            break
        if step == 4:
            for index in aborts:
                scheduler.abort(f"q{index}")
        plan = scheduler.schedule()
        assert plan.num_scheduled_tokens <= budget
        assert all(len(c.draft_token_ids) <= max_k for c in plan.continuing_requests)
        plan.want_held_requests = True
        in_flight.append(executor.execute(plan))
        if pipelined and len(in_flight) < 2 and plan.has_work:
            continue
        output = in_flight.pop(0)
        for update in scheduler.update(output):
            assert update.error is None, update.error
            done = update.request
            # A follow-up request whose prompt is a finished one's prompt and output: it hits
            # the blocks that request's drafts filled.
            if update.finished and done.finish_reason is FinishReason.LENGTH and follow_ups:
                follow_ups -= 1
                add(Request(f"{done.request_id}+", list(done.token_ids), SamplingParams(max_tokens=3, ignore_eos=True)))
        if not in_flight:
            assert output.held_requests is not None
            assert audit_executor(scheduler, output.held_requests) == [], f"step {step}"
            _check_blocks(scheduler, max_k)
    else:
        raise AssertionError("the scheduler did not finish")
    assert scheduler.kv.num_free_blocks == num_blocks
    for request in requests:
        reference = decode_one_at_a_time(model, request.prompt_token_ids, request.num_output_tokens)
        assert request.output_token_ids == reference
        if request.finish_reason is FinishReason.LENGTH:
            assert request.num_tokens == min(request.num_prompt_tokens + (request.sampling.max_tokens or 0), config.max_seq_len)
