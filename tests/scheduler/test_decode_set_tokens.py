"""A request decoding in bulk keeps its newest tokens in its DecodeSet slot, not in its list:
whoever reads its tokens, at any point, and whatever it does after it leaves, sees every token
in order, as though each had been appended to its list as it came."""

from hypothesis import given, settings
from hypothesis import strategies as st

from kv_manager.prefix_hash import pack_tokens
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


@settings(max_examples=60, deadline=None)
@given(
    prompt_len=st.integers(1, 3 * BLOCK_SIZE),
    reads=st.lists(st.booleans(), min_size=20 * BLOCK_SIZE, max_size=20 * BLOCK_SIZE),
)
def test_each_completed_block_comes_with_exactly_its_tokens(prompt_len: int, reads: list[bool]) -> None:
    """Whatever reads of the request's tokens happen between steps (each moves the slot's tokens
    into its list), every block its computed tokens complete is reported once, either packed
    from its row as the prefix hash takes it or (when part of it is in the list already) for
    the general path, and the packed tokens are the block's."""
    decodes = DecodeSet(BLOCK_SIZE, eos_token_ids=())
    prompt = list(range(1, prompt_len + 1))
    request = Request("a", list(prompt), SamplingParams(max_tokens=1000, ignore_eos=True))
    # Its prefill computed the prompt and sampled the token after it.
    request.num_computed_tokens = prompt_len
    request.token_ids.append(500)
    decodes.join(request, handle=1, cover=10_000, limit=10_000)
    completed = []
    for index, read in enumerate(reads):
        bulk = decodes.plan(budget=1)
        assert bulk is not None
        filled = decodes.apply(bulk, [1000 + index], now=0.0).filled
        for packed, computed in zip(filled.packed_blocks, filled.num_computed, strict=True):
            tokens = decodes.tokens_of(request)
            assert packed == pack_tokens(tokens[computed - BLOCK_SIZE : computed])
            completed.append(computed)
        completed += [computed for _, computed in filled.others]
        if read:
            assert request.token_ids[-1] == 1000 + index
    final = prompt_len + len(reads)
    assert completed == list(range(BLOCK_SIZE * (prompt_len // BLOCK_SIZE + 1), final + 1, BLOCK_SIZE))
    assert request.token_ids == [*prompt, 500, *range(1000, 1000 + len(reads))]
