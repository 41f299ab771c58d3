"""Speculative decoding's proposers: prompt lookup finds what followed a repeated phrase in the
request's own tokens, and the suffix table learns continuations across requests within its
memory bound."""

from __future__ import annotations

import random
import tracemalloc

import numpy as np
from hypothesis import given, settings
from hypothesis import strategies as st

from scheduler_service.core.ngram_proposer import (
    MAX_NGRAM,
    MIN_NGRAM,
    NgramProposer,
    TokenArrays,
    lookup,
)
from scheduler_service.core.request import FinishReason, Request, RequestStatus
from scheduler_service.core.sampling_params import SamplingParams
from scheduler_service.core.suffix_proposer import CONTEXTS, SuffixProposer, SuffixTable


def _request(tokens: list[int], prompt_len: int | None = None, request_id: str = "r") -> Request:
    prompt_len = len(tokens) if prompt_len is None else prompt_len
    request = Request(request_id, tokens[:prompt_len], SamplingParams(max_tokens=64))
    request.token_ids = list(tokens)
    return request


def _finished(tokens: list[int], prompt_len: int, request_id: str) -> Request:
    request = _request(tokens, prompt_len, request_id)
    request.status, request.finish_reason = RequestStatus.FINISHED, FinishReason.STOP
    return request


def test_ngram_proposes_what_followed_the_repeated_phrase() -> None:
    # "the cat sat on the mat . the cat" -> "sat on the mat".
    the, cat, sat, on, mat, dot = 11, 12, 13, 14, 15, 16
    request = _request([the, cat, sat, on, the, mat, dot, the, cat])
    assert NgramProposer().propose(request, 4) == [sat, on, the, mat]


def test_ngram_prefers_the_longest_match_then_the_latest() -> None:
    # [1, 2] occurs twice, [7, 1, 2] once (earlier): the longer context wins.
    assert lookup(np.array([7, 1, 2, 30, 1, 2, 40, 7, 1, 2]), 1).tokens == [30]
    # Two occurrences of the same length: the latest.
    assert lookup(np.array([1, 2, 30, 1, 2, 40, 1, 2]), 1).tokens == [40]
    # A suffix of one token says too little.
    assert lookup(np.array([1, 5, 9, 1]), 3).tokens == []
    assert MIN_NGRAM == 2


def test_ngram_continues_a_short_period_through_its_own_proposal() -> None:
    assert lookup(np.array([4, 5, 6, 4, 5]), 5).tokens == [6, 4, 5, 6, 4]
    assert lookup(np.array([9, 9, 9]), 4).tokens == [9, 9, 9, 9]


def _naive(tokens: list[int], k: int) -> list[int]:
    """The definition, spelled out: longest suffix (MAX_NGRAM..MIN_NGRAM) seen earlier, latest
    earlier occurrence, the tokens after it (continued through the proposal itself)."""
    length = len(tokens)
    for n in range(min(MAX_NGRAM, length - 1), MIN_NGRAM - 1, -1):
        suffix = tokens[length - n :]
        for end in range(length - 1, n - 1, -1):
            if tokens[end - n : end] == suffix:
                extended = list(tokens)
                while len(extended) < end + k:
                    extended.append(extended[len(extended) - (length - end)])
                return extended[end : end + k]
    return []


@settings(max_examples=300, deadline=None)
@given(st.lists(st.integers(0, 4), max_size=40), st.integers(1, 6))
def test_ngram_lookup_agrees_with_the_definition(tokens: list[int], k: int) -> None:
    assert lookup(np.array(tokens, dtype=np.int64), k).tokens == _naive(tokens, k)


@settings(max_examples=100, deadline=None)
@given(st.lists(st.lists(st.integers(0, 1000), max_size=80), min_size=1, max_size=8))
def test_token_arrays_follow_a_request_as_it_grows(chunks: list[list[int]]) -> None:
    arrays = TokenArrays()
    request = _request([1])
    for chunk in chunks:
        request.token_ids.extend(chunk)
        assert arrays.of(request).tolist() == request.token_ids
    arrays.leave(request)
    assert len(arrays) == 0


def test_suffix_proposes_another_requests_continuation() -> None:
    table = SuffixTable()
    proposer = SuffixProposer(table)
    answer = list(range(500, 540))
    # A request answered with `answer` after its own prompt, then finished.
    proposer.leave(_finished([1, 2, 3, 4, 5, 6, 7, 8, 9] + answer, 9, "first"))
    assert table.num_sequences == 1
    # Another one, with another prompt, has begun the same answer: the table goes on with it,
    # where its own tokens have nothing.
    second = _request([90, 91, 92, *answer[:10]], 3, "second")
    assert NgramProposer().propose(second, 4) == []
    assert proposer.propose(second, 4) == answer[10:14]


def test_suffix_falls_back_to_the_requests_own_tokens_and_prefers_them_on_a_tie() -> None:
    proposer = SuffixProposer(SuffixTable())
    own = _request([1, 2, 3, 4, 50, 60, 1, 2, 3, 4])
    assert proposer.propose(own, 2) == [50, 60]
    # A finished request that went on differently after the same four tokens: a tie of four,
    # the request's own continuation stays.
    proposer.leave(_finished([1, 2, 3, 4, 77, 78, 79], 1, "other"))
    assert proposer.propose(own, 2) == [50, 60]
    # Eight tokens of context in the table beat four of its own.
    longer = _request([9, 8, 7, 6, 1, 2, 3, 4, 50, 60, 5, 6, 7, 9, 8, 7, 6, 1, 2, 3, 4])
    proposer.leave(_finished([9, 8, 7, 6, 1, 2, 3, 4, 88, 89], 1, "long"))
    assert proposer.propose(longer, 2) == [88, 89]


def test_a_request_that_did_not_finish_teaches_nothing() -> None:
    table = SuffixTable()
    proposer = SuffixProposer(table)
    proposer.leave(_request(list(range(40)), 5, "moved away"))
    assert table.num_sequences == 0


def test_the_suffix_table_keeps_to_its_bound_and_forgets_the_least_recently_used() -> None:
    table = SuffixTable(max_tokens=1000)
    rng = random.Random(1)
    kept: list[list[int]] = []
    for _ in range(200):
        sequence = [rng.randrange(10_000) for _ in range(rng.randrange(5, 300))]
        table.add(sequence)
        kept.append(sequence)
        assert table.num_tokens <= 1000
        assert table.num_index_entries <= len(CONTEXTS) * table.num_tokens
    latest = list(range(30_000, 30_050))
    table.add(latest)
    # The latest is held and continued; the first is long gone, its index entries with it.
    first = kept[0]
    assert table.match(latest[:8], 3).tokens == latest[8:11]
    assert table.match(first[:8], 3).tokens == []
    # A sequence longer than the whole table keeps its tail.
    table.add(list(range(20_000, 22_000)))
    assert table.num_tokens == 1000 and table.num_sequences == 1
    assert table.match(list(range(21_100, 21_108)), 2).tokens == [21_108, 21_109]


def test_a_recently_used_sequence_outlives_older_unused_ones() -> None:
    table = SuffixTable(max_tokens=100)
    first, second = list(range(100, 140)), list(range(200, 240))
    table.add(first)
    table.add(second)
    assert table.match(first[:8], 1).tokens == [first[8]]
    table.add(list(range(300, 340)))
    assert table.match(first[:8], 1).tokens == [first[8]]
    assert table.match(second[:8], 1).tokens == []


def test_the_default_table_holds_its_documented_memory_bound() -> None:
    rng = random.Random(2)
    sequences = [[rng.randrange(1000, 150_000) for _ in range(500)] for _ in range(300)]
    tracemalloc.start()
    try:
        table = SuffixTable()
        for sequence in sequences:
            table.add(sequence)
        used, _ = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
    assert table.num_tokens > 60_000
    # The module docstring's figure: about 300 bytes per token held, 20 MB for the default.
    assert used / table.num_tokens < 400
