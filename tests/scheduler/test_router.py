"""Routing across executors' schedulers: prefix affinity is exact (cached or already placed
blocks), weighed against load; requests move between schedulers without losing their place."""

from __future__ import annotations

from scheduler_service.core.config import SchedulerConfig
from scheduler_service.core.policy import Policy
from scheduler_service.core.request import Request, RequestStatus
from scheduler_service.core.router import route
from scheduler_service.core.sampling_params import SamplingParams
from scheduler_service.core.scheduler import Scheduler
from scheduler_service.core.sim_executor import SimulatedExecutor, default_next_token

BLOCK = 4


def scheduler(num_blocks: int = 64, block_copies: bool = False) -> Scheduler:
    return Scheduler(SchedulerConfig(num_kv_blocks=num_blocks, block_size=BLOCK, max_model_len=512, block_copies=block_copies))


def request(request_id: str, prompt: list[int], max_tokens: int = 4) -> Request:
    return Request(request_id, prompt, SamplingParams(max_tokens=max_tokens, ignore_eos=True))


SHARED = list(range(100, 132))  # 8 full blocks


def test_a_prompt_goes_where_its_prefix_is_cached_or_already_placed() -> None:
    lanes = [scheduler(), scheduler()]
    first = request("first", SHARED + [1, 2])
    lanes[1].add_request(first)
    # Placed, not yet computed: lane 1 will hold the shared blocks.
    follower = request("follower", SHARED + [3, 4])
    choice = route(follower, lanes, tokens_per_request=16)
    assert choice is not None and choice.index == 1 and choice.affinity == len(SHARED)
    # Computed and cached, then finished: lane 1's cache still holds them.
    executor = SimulatedExecutor(64, BLOCK)
    while lanes[1].has_unfinished():
        lanes[1].update(executor.execute(lanes[1].schedule()))
    assert lanes[1].load == 0
    assert route(request("later", SHARED + [5]), lanes, tokens_per_request=16).index == 1


def test_load_outweighs_a_short_shared_prefix() -> None:
    lanes = [scheduler(), scheduler()]
    for index in range(4):
        lanes[0].add_request(request(f"busy{index}", SHARED[:8] + [index] * 9))
    # 8 shared tokens are worth less than 4 queued requests at 16 tokens each.
    assert route(request("new", SHARED[:8] + [7, 7]), lanes, tokens_per_request=16).index == 1
    # Routing by prefix alone keeps it with its prefix.
    assert route(request("new", SHARED[:8] + [7, 7]), lanes, tokens_per_request=0).index == 0


def test_an_executor_too_small_for_the_request_is_no_candidate() -> None:
    lanes = [scheduler(num_blocks=2), scheduler()]
    assert route(request("long", list(range(20))), lanes).index == 1
    assert route(request("long", list(range(20))), lanes[:1]) is None


def test_requests_move_between_executors_keeping_tokens_and_arrival_order() -> None:
    source, target = scheduler(), scheduler()
    executor = SimulatedExecutor(64, BLOCK)
    moved = [request(f"m{i}", [10 * i + 1, 10 * i + 2, 10 * i + 3], max_tokens=6) for i in range(3)]
    for item in moved:
        source.add_request(item)
    for _ in range(2):
        source.update(executor.execute(source.schedule()))
    # Arrival order is the service's, across executors (the engine numbers arrivals).
    local = request("local", [90, 91])
    local.arrival_index = 3
    target.add_request(local)
    evicted = source.evict_all()
    assert evicted == moved and source.load == 0 and source.kv.num_free_blocks == 64
    assert all(r.status is RequestStatus.WAITING and r.num_computed_tokens == 0 for r in evicted)
    for item in evicted:
        assert target.adopt(item)
    # Earlier arrivals keep their place ahead of the target's own later arrival.
    assert [r.request_id for r in target.waiting] == ["m0", "m1", "m2", "local"]
    executor = SimulatedExecutor(64, BLOCK)
    while target.has_unfinished():
        target.update(executor.execute(target.schedule()))
    for item in moved:
        tokens = list(item.prompt_token_ids)
        for _ in range(6):
            tokens.append(default_next_token("", tokens))
        assert item.token_ids == tokens


def test_released_requests_leave_with_their_placement() -> None:
    lane = scheduler()
    queued = [request(f"w{index}", SHARED[: 4 * (index + 1)] + [index]) for index in range(5)]
    for item in queued:
        lane.add_request(item)
    assert lane.affinity(request("probe", SHARED + [1])) == 5 * BLOCK
    released = lane.release_waiting(queued[:1:-1])
    assert [r.request_id for r in released] == ["w2", "w3", "w4"]
    assert lane.load == 2 and [r.request_id for r in lane.waiting] == ["w0", "w1"]
    # Only what the remaining requests will compute counts now.
    assert lane.affinity(request("probe", SHARED + [1])) == 2 * BLOCK


def test_a_sibling_choice_goes_where_its_first_choice_is_whatever_the_load_when_it_would_fork_there() -> None:
    lanes = [scheduler(block_copies=True), scheduler(block_copies=True)]
    lanes[1].add_request(request("busy", [7, 8, 9]))
    lanes[1].add_request(request("a", [1, 2, 3, 4, 5]))
    sibling = Request("a#1", [1, 2, 3, 4, 5], SamplingParams(max_tokens=4), fork_of="a")
    assert route(sibling, lanes, tokens_per_request=1000).index == 1
    assert route(request("other", [1, 2, 3, 4, 5]), lanes, tokens_per_request=1000).index == 0
    # With output of its own (its executor was lost), it computes its prompt wherever it goes.
    resumed = Request("a#1", [1, 2, 3, 4, 5], SamplingParams(max_tokens=4), fork_of="a", token_ids=[1, 2, 3, 4, 5, 9])
    assert route(resumed, lanes, tokens_per_request=1000).index == 0
    # So does one whose first choice's executor copies no blocks.
    plain = [scheduler(), scheduler()]
    plain[1].add_request(request("busy", [7, 8, 9]))
    plain[1].add_request(request("a", [1, 2, 3, 4, 5]))
    assert route(sibling, plain, tokens_per_request=1000).index == 0


def test_under_priority_a_request_goes_where_it_can_take_a_lower_priority_seat() -> None:
    def full_lane(priority: int) -> Scheduler:
        lane = Scheduler(
            SchedulerConfig(num_kv_blocks=64, block_size=BLOCK, max_model_len=512, max_num_seqs=2, policy=Policy.PRIORITY)
        )
        for index in range(2):
            lane.add_request(Request(f"p{priority}-{index}", [priority, index, 9], SamplingParams(max_tokens=50), priority=priority))
        lane.schedule()
        assert len(lane.running) == 2
        return lane

    # Lane 0 is full of requests as urgent as the newcomer, and holds its prefix; lane 1 runs
    # requests it outranks.
    lanes = [full_lane(0), full_lane(5)]
    urgent = Request("urgent", [0, 0, 9], SamplingParams(max_tokens=4), priority=0)
    assert route(urgent, lanes, tokens_per_request=0).index == 1
    # One no more urgent than anyone running goes by the scores, as under FCFS.
    assert route(Request("calm", [0, 0, 9], SamplingParams(max_tokens=4), priority=5), lanes, tokens_per_request=0).index == 0


def test_an_urgent_request_does_not_go_where_its_equals_queue_ahead_of_it() -> None:
    config = SchedulerConfig(num_kv_blocks=256, block_size=BLOCK, max_model_len=512, max_num_seqs=2, policy=Policy.PRIORITY)
    crowded, full = Scheduler(config), Scheduler(config)
    # Crowded: one priority-5 request running beside a priority-0 one, and many priority-0
    # requests queued. Full: two priority-0 requests running, nothing queued.
    crowded.add_request(Request("c-low", [5, 1, 9], SamplingParams(max_tokens=50), priority=5))
    crowded.add_request(Request("c-high", [0, 1, 9], SamplingParams(max_tokens=50), priority=0))
    crowded.schedule()
    for index in range(20):
        crowded.add_request(Request(f"c-q{index}", [0, 2, index], SamplingParams(max_tokens=50), priority=0))
    for index in range(2):
        full.add_request(Request(f"f{index}", [0, 3, index], SamplingParams(max_tokens=50), priority=0))
    full.schedule()
    urgent = Request("urgent", [0, 4, 9], SamplingParams(max_tokens=4), priority=0)
    # Neither starts it at once, so the scores decide: the full one, with less load.
    assert route(urgent, [crowded, full], tokens_per_request=16).index == 1
