"""Requests moving between two executors' planners with their K/V (Scheduler.begin_move, depart,
import_request, end_export), each planner driving a simulated executor that checks every slot
a request attends over holds that request's token, with plans pipelined two deep.

The orchestration here is what planner/kv_moves.py does between lanes; the property is the one
a client notices: every request gets the tokens it would have got had it never moved, nothing
is computed twice unless a transfer failed, and both pools' books end clean."""

import random
from collections import deque
from dataclasses import dataclass, field

import pytest

from kv_manager.audit import pool_mismatches
from scheduler_service.core.config import SchedulerConfig
from scheduler_service.core.move_books import Departure
from scheduler_service.core.request import Request
from scheduler_service.core.scheduler import Scheduler
from scheduler_service.core.sim_executor import SimulatedExecutor
from scheduler_service.core.step_plan import ImportDone, StepOutput, StepPlan
from tests.helpers.sched_harness import make_request

BLOCK_SIZE = 4


@dataclass
class Side:
    """One executor: its planner, its simulated executor, plans on the wire (two deep)."""

    address: str
    scheduler: Scheduler
    sim: SimulatedExecutor
    in_flight: deque = field(default_factory=deque)
    computed: int = 0

    def step(self) -> list:
        """Sends plans while there is room on the wire, then applies the oldest result."""
        while len(self.in_flight) < 2:
            plan: StepPlan = self.scheduler.schedule()
            if not (plan.has_work or plan.dropped_request_ids or plan.has_moves):
                break
            self.computed += plan.num_scheduled_tokens
            self.in_flight.append(self.sim.execute(plan))
        if not self.in_flight:
            self.in_flight.append(self.sim.execute(self.scheduler.schedule()))
        return self.scheduler.update(self.in_flight.popleft())


def pair(num_blocks: int = 64, budget: int = 32, state_slots: int = 0) -> tuple[Side, Side]:
    """state_slots: a hybrid model's (its requests' recurrent state moves with their blocks),
    with checkpoints every 2 blocks."""
    config = SchedulerConfig(
        num_kv_blocks=num_blocks, block_size=BLOCK_SIZE, max_model_len=256, max_num_batched_tokens=budget,
        num_state_slots=state_slots, state_checkpoint_blocks=2 if state_slots else 0,
    )
    sides = [
        Side(name, Scheduler(config), SimulatedExecutor(num_blocks, BLOCK_SIZE, num_state_slots=state_slots))
        for name in ("a", "b")
    ]
    for side in sides:
        side.sim.peers = {other.address: other.sim for other in sides}
    return sides[0], sides[1]


class Orchestra:
    """planner/kv_moves.py's part, between two sides."""

    def __init__(self, sides: tuple[Side, Side]) -> None:
        self.sides = sides
        self.moves: dict[str, tuple[Departure, Side]] = {}
        self.tokens: dict[str, list[int]] = {}
        self.num_moved = 0
        # Tokens each moved request had computed when it left.
        self.departed: dict[str, int] = {}

    def other(self, side: Side) -> Side:
        return self.sides[1] if side is self.sides[0] else self.sides[0]

    def step(self, side: Side) -> None:
        updates = side.step()
        for update in updates:
            if update.finished:
                self.tokens[update.request_id] = list(update.request.output_token_ids)
        for done, request in updates.imports_done:
            departure, source = self.moves.pop(done.transfer_id)
            source.scheduler.end_export(done.transfer_id)
            self.num_moved += done.ok and request is not None
        for transfer_id in updates.offers_ready:
            departure, _ = self.moves[transfer_id]
            destination = self.other(side)
            fetching = destination.scheduler.import_request(departure.request, departure, side.address)
            if fetching is None:
                departure.request.lose_kv("transfer_failed")
                destination.scheduler.adopt(departure.request)
            if not fetching:
                del self.moves[transfer_id]
                side.scheduler.end_export(transfer_id)
        for request in side.scheduler.ready_to_move():
            departure = side.scheduler.depart(request)
            self.moves[departure.transfer_id] = (departure, side)
            self.departed[request.request_id] = departure.num_computed_tokens

    def busy(self) -> bool:
        return bool(self.moves) or any(
            side.scheduler.has_unfinished() or side.scheduler.num_exports or side.in_flight for side in self.sides
        )

    def flush(self) -> None:
        """One more plan each: offers ended by the last results go out."""
        for side in self.sides:
            side.sim.execute(side.scheduler.schedule())


def reference_tokens(requests: list[Request]) -> dict[str, list[int]]:
    """What each request gets on one executor that never moves anything."""
    side, _ = pair(num_blocks=256, state_slots=len(requests))
    for request in requests:
        side.scheduler.add_request(request)
    tokens = {}
    while side.scheduler.has_unfinished() or side.in_flight:
        for update in side.step():
            if update.finished:
                tokens[update.request_id] = list(update.request.output_token_ids)
    return tokens


def fresh(count: int, seed: int) -> list[Request]:
    rng = random.Random(seed)
    return [make_request(i, rng.randint(3, 30), rng.randint(1, 24)) for i in range(count)]


@pytest.mark.parametrize(("state_slots", "seed"), [(0, 1), (6, 5)], ids=["attention", "hybrid"])
def test_moved_requests_continue_from_their_kv_without_recomputing(state_slots: int, seed: int) -> None:
    """The destination takes each request up from the K/V (and for a hybrid model the recurrent
    state, state_in_slot) the source offered, computing nothing it had computed."""
    a, b = pair(state_slots=state_slots)
    orchestra = Orchestra((a, b))
    requests = fresh(4, seed=seed)
    expected = reference_tokens(fresh(4, seed=seed))
    for request in requests:
        a.scheduler.add_request(request)
    for _ in range(6):
        orchestra.step(a)
    moving = [r for r in a.scheduler.running if r.num_output_tokens]
    assert moving, "some requests decode on a by now"
    for request in moving:
        a.scheduler.begin_move(request)
    while orchestra.busy():
        orchestra.step(a)
        orchestra.step(b)
    orchestra.flush()
    assert orchestra.tokens == expected
    assert orchestra.num_moved == len(moving)
    # b computed only what came after the K/V each moved request brought (a request computes
    # its prompt and every output token but the last).
    by_id = {r.request_id: r for r in requests}
    assert b.computed == sum(
        by_id[rid].num_prompt_tokens + len(expected[rid]) - 1 - brought for rid, brought in orchestra.departed.items()
    )
    for side in (a, b):
        assert not side.scheduler.recomputed_tokens
        assert pool_mismatches(side.scheduler.kv) == []
        assert side.scheduler.kv.num_free_blocks == 64
        assert side.scheduler.kv.state_slots.num_held == 0
        assert not side.sim.offers


def test_a_failed_fetch_recomputes_from_the_tokens_kept() -> None:
    a, b = pair()
    orchestra = Orchestra((a, b))
    requests = fresh(3, seed=2)
    expected = reference_tokens(fresh(3, seed=2))
    for request in requests:
        a.scheduler.add_request(request)
    for _ in range(5):
        orchestra.step(a)
    moving = [r for r in a.scheduler.running if r.num_output_tokens and not r.is_finished]
    for request in moving:
        a.scheduler.begin_move(request)
    # b cannot reach a: every fetch fails.
    b.sim.peers = {}
    while orchestra.busy():
        orchestra.step(a)
        orchestra.step(b)
    assert orchestra.tokens == expected
    assert orchestra.num_moved == 0
    assert b.scheduler.recomputed_tokens["transfer_failed"] > 0
    for side in (a, b):
        assert pool_mismatches(side.scheduler.kv) == []
        assert side.scheduler.kv.num_free_blocks == 64


def test_a_request_ended_while_its_blocks_are_fetched_cancels_the_import() -> None:
    a, b = pair()
    orchestra = Orchestra((a, b))
    request = make_request(0, 12, 30)
    a.scheduler.add_request(request)
    for _ in range(4):
        orchestra.step(a)
    a.scheduler.begin_move(request)
    while b.scheduler.num_importing == 0:
        orchestra.step(a)
    b.scheduler.abort(request.request_id)
    plan = b.scheduler.schedule()
    assert plan.cancelled_imports or not b.sim.imports
    b.sim.execute(plan)
    (transfer_id,) = list(orchestra.moves)
    a.scheduler.end_export(transfer_id)
    for _ in range(3):
        orchestra.step(a)
    assert b.scheduler.kv.num_free_blocks == 64 and a.scheduler.kv.num_free_blocks == 64
    assert pool_mismatches(a.scheduler.kv) == pool_mismatches(b.scheduler.kv) == []


def test_a_prefill_executor_hands_each_request_on_after_its_first_token() -> None:
    a, b = pair()
    a.scheduler.hand_off_after_prefill = True
    orchestra = Orchestra((a, b))
    requests = fresh(5, seed=3)
    expected = reference_tokens(fresh(5, seed=3))
    for request in requests:
        a.scheduler.add_request(request)
    while orchestra.busy():
        orchestra.step(a)
        orchestra.step(b)
    assert orchestra.tokens == expected
    prompts = sum(r.num_prompt_tokens for r in requests)
    # a computed prompts only; b only the tokens after each first one.
    assert a.computed == prompts
    assert b.computed == sum(max(0, len(tokens) - 1) for tokens in expected.values())


@pytest.mark.parametrize("state_slots", [0, 4])
@pytest.mark.parametrize("seed", range(12))
def test_moves_both_ways_under_preemption_keep_every_token(seed: int, state_slots: int) -> None:
    """Small pools (preemptions), moves begun at random moments both ways, some refused for
    room: tokens as if nothing moved, books clean; for a hybrid model (state slots, few of
    them) each moved request's recurrent state goes with it."""
    rng = random.Random(seed)
    a, b = pair(num_blocks=24, budget=16, state_slots=state_slots)
    orchestra = Orchestra((a, b))
    requests = fresh(10, seed=100 + seed)
    expected = reference_tokens(fresh(10, seed=100 + seed))
    for request in requests:
        rng.choice((a, b)).scheduler.add_request(request)
    steps = 0
    while orchestra.busy():
        steps += 1
        assert steps < 5000, "the moves never settle"
        side = rng.choice((a, b))
        orchestra.step(side)
        if rng.random() < 0.2 and side.scheduler.running:
            side.scheduler.begin_move(rng.choice(side.scheduler.running))
    orchestra.flush()
    assert orchestra.tokens == expected
    for side in (a, b):
        assert pool_mismatches(side.scheduler.kv) == []
        assert side.scheduler.kv.num_free_blocks == 24
        assert side.scheduler.kv.state_slots.num_held == 0
        assert not side.sim.offers


def _arrive_with_kv(scheduler: Scheduler, requests: list[Request]) -> None:
    """The requests arrive at scheduler with their K/V (imports that succeed)."""
    for request in requests:
        request.num_computed_tokens = request.num_tokens - 1
        blocks = list(range(-(-request.num_computed_tokens // BLOCK_SIZE)))
        departure = Departure(request, request.request_id, blocks, request.num_computed_tokens)
        assert scheduler.import_request(request, departure, "a")
    plan = scheduler.schedule()
    assert [i.transfer_id for i in plan.kv_imports] == [r.request_id for r in requests]
    scheduler.update(StepOutput(step_id=plan.step_id, kv_imports_done=[ImportDone(r.request_id, True) for r in requests]))


def test_requests_holding_imported_kv_give_it_up_for_a_head_that_cannot_fit_otherwise() -> None:
    """A prompt queued first needs more blocks than are free, because requests that arrived
    after it with their K/V hold them, and nothing runs to free any: they give theirs up (to be
    recomputed: no host tier) and the prompt runs, rather than the executor stalling for good."""
    config = SchedulerConfig(num_kv_blocks=16, block_size=BLOCK_SIZE, max_model_len=256, max_num_batched_tokens=64)
    scheduler = Scheduler(config)
    head = make_request(0, 40, 4)
    scheduler.add_request(head)
    head.arrival_index = 0
    # Planned before the head could run: the imports take 12 of the 16 blocks.
    scheduler.waiting.remove(head)
    arrived = [make_request(index, 22, 8) for index in (1, 2)]
    for index, request in enumerate(arrived, start=1):
        request.arrival_index = index
    _arrive_with_kv(scheduler, arrived)
    scheduler.waiting.insert(head)
    assert scheduler.kv.num_free_blocks == 4
    plan = scheduler.schedule()
    assert [new.request_id for new in plan.new_requests][:1] == ["r0"]
    # Both gave up the 21 tokens of K/V they brought: recomputed, or to be once admitted.
    assert scheduler.recomputed_tokens["released"] + sum(r.num_lost_tokens for r in scheduler.queued) == 2 * 21


def test_a_request_retried_alone_is_not_moved() -> None:
    a, _ = pair()
    request = make_request(0, 12, 20)
    a.scheduler.add_request(request)
    a.step()
    request.retry_alone = True
    a.scheduler.begin_move(request)
    assert not request.moving and a.scheduler.ready_to_move() == []


def test_a_request_leaves_only_once_its_prompt_chunk_in_flight_is_answered() -> None:
    """A chunk that samples nothing may still fail: until its result is in, the K/V it writes
    is not known to be there, and the request is not ready to leave."""
    a, _ = pair(budget=8)
    request = make_request(0, 30, 4)
    a.scheduler.add_request(request)
    plan = a.scheduler.schedule()
    assert plan.new_requests and request.num_pending_outputs == 0
    a.scheduler.begin_move(request)
    assert a.scheduler.ready_to_move() == []
    a.scheduler.update(a.sim.execute(plan))
    assert a.scheduler.ready_to_move() == [request]
