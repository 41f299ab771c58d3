"""A request decoding in bulk keeps its newest tokens in its DecodeSet slot, not in its list:
whoever reads its tokens, at any point, and whatever it does after it leaves, sees every token
in order, as though each had been appended to its list as it came."""

from scheduler_service.core.decode_set import DecodeSet
from scheduler_service.core.request import Request
from scheduler_service.core.sampling_params import SamplingParams

BLOCK_SIZE = 4
PROMPT = [1, 2, 3, 4]


def joined(decodes: DecodeSet, request_id: str) -> Request:
    request = Request(request_id, list(PROMPT), SamplingParams(max_tokens=1000, ignore_eos=True))
    request.num_computed_tokens = len(PROMPT)
    decodes.join(request, handle=len(decodes) + 1, cover=10_000, limit=10_000)
    return request


def step(decodes: DecodeSet, tokens_by_request: dict[Request, int]) -> None:
    bulk = decodes.plan(budget=1_000)
    assert bulk is not None
    order = decodes.live(bulk)
    decodes.apply(bulk, [tokens_by_request[request] for request in order], now=0.0)


def test_tokens_read_at_any_step_are_every_token_so_far() -> None:
    decodes = DecodeSet(BLOCK_SIZE, eos_token_ids=())
    request = joined(decodes, "a")
    for token in range(100, 130):
        step(decodes, {request: token})
        assert request.token_ids == [*PROMPT, *range(100, token + 1)]
        assert request.num_output_tokens == token - 99


def test_tokens_never_read_while_decoding_survive_a_full_slot_and_leaving() -> None:
    """Many blocks' worth with nobody reading: the slot fills and hands its tokens to the list
    on its own, and the request that leaves takes the rest, next to a neighbour that stays."""
    decodes = DecodeSet(BLOCK_SIZE, eos_token_ids=())
    leaving, staying = joined(decodes, "a"), joined(decodes, "b")
    count = 7 * BLOCK_SIZE + 3
    for index in range(count):
        step(decodes, {leaving: 1000 + index, staying: 2000 + index})
    decodes.leave(leaving)
    assert type(leaving) is Request, "it holds its progress itself again"
    assert leaving.token_ids == [*PROMPT, *range(1000, 1000 + count)]
    assert staying.token_ids == [*PROMPT, *range(2000, 2000 + count)]


def test_a_reused_slot_starts_empty() -> None:
    decodes = DecodeSet(BLOCK_SIZE, eos_token_ids=())
    first = joined(decodes, "a")
    for token in (7, 8, 9):
        step(decodes, {first: token})
    decodes.leave(first)
    second = joined(decodes, "b")
    step(decodes, {second: 50})
    assert second.token_ids == [*PROMPT, 50]
    assert first.token_ids == [*PROMPT, 7, 8, 9]


def test_assigning_a_token_list_replaces_every_token() -> None:
    decodes = DecodeSet(BLOCK_SIZE, eos_token_ids=())
    request = joined(decodes, "a")
    step(decodes, {request: 60})
    request.token_ids = [*PROMPT, 61]
    step(decodes, {request: 62})
    assert request.token_ids == [*PROMPT, 61, 62]
