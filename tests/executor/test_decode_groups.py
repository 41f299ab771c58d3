"""Decodes are attended in groups of similar context length: every sequence in exactly one
group, each at least GROUP_MIN_SHARE of its group's longest."""

from hypothesis import given
from hypothesis import strategies as st

from executor_service.attention.attention_metadata import (
    GROUP_MIN_SHARE,
    SequenceSpan,
    group_by_context,
)


@given(st.lists(st.integers(1, 4096), min_size=1, max_size=64))
def test_each_decode_is_in_one_group_of_contexts_close_to_its_own(lengths: list[int]) -> None:
    spans = [SequenceSpan(token_start=i, num_new=1, num_cached=n - 1, block_ids=()) for i, n in enumerate(lengths)]
    groups = group_by_context(spans)
    assert sorted(s.token_start for g in groups for s in g) == list(range(len(lengths)))
    for group in groups:
        longest = max(s.context_len for s in group)
        assert all(s.context_len >= GROUP_MIN_SHARE * longest for s in group)
    # Groups never overlap in length, so no two could have been one.
    bounds = [(min(s.context_len for s in g), max(s.context_len for s in g)) for g in groups]
    assert all(low > next_high for (low, _), (_, next_high) in zip(bounds, bounds[1:]))
