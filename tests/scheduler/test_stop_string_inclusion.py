"""IncrementalDetokenizer with include_stop_str_in_output (vLLM's field): the output ends with the
stop string that ended it, however the tokens that spell it were grouped, and nothing is held
back while it waits to see whether a stop string follows."""

from __future__ import annotations

from collections.abc import Sequence

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from transformers import AutoTokenizer, PreTrainedTokenizerBase

from scheduler_service.text.detokenizer import IncrementalDetokenizer
from tests.helpers.tokenizer_assets import gpt2_tokenizer_dir, qwen3_tokenizer_dir

# Characters of 1 to 4 UTF-8 bytes, which byte-level tokenizers split across tokens.
ALPHABET = "ab ,.é中文😀\n"


@pytest.fixture(scope="module", params=["gpt2", "qwen3"])
def tokenizer(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory) -> PreTrainedTokenizerBase:
    if request.param == "gpt2":
        return AutoTokenizer.from_pretrained(gpt2_tokenizer_dir(tmp_path_factory.mktemp("gpt2")))
    return AutoTokenizer.from_pretrained(qwen3_tokenizer_dir())


def including(tokenizer: PreTrainedTokenizerBase, stop: Sequence[str], min_tokens: int = 0) -> IncrementalDetokenizer:
    return IncrementalDetokenizer(
        tokenizer, [], skip_special_tokens=True, stop=stop, min_tokens=min_tokens, include_stop_str_in_output=True
    )


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(data=st.data())
def test_the_output_ends_with_the_stop_string_that_ended_it(
    tokenizer: PreTrainedTokenizerBase, data: st.DataObject
) -> None:
    text = data.draw(st.text(alphabet=ALPHABET, min_size=2, max_size=30), label="text")
    ids = tokenizer.encode(text, add_special_tokens=False)
    decoded = tokenizer.decode(ids)
    start = data.draw(st.integers(min_value=0, max_value=len(decoded) - 1), label="stop start")
    length = data.draw(st.integers(min_value=1, max_value=6), label="stop length")
    decoy = data.draw(st.text(ALPHABET, min_size=1, max_size=4), label="decoy stop")
    stops = [decoded[start : start + length], decoy]
    # The stop string whose first occurrence ends first (ties: the one starting first).
    found = sorted((decoded.find(s) + len(s), decoded.find(s), s) for s in stops if s in decoded)
    end, _, stop = found[0]
    detokenizer = including(tokenizer, stops)

    streamed, reported, position = "", None, 0
    while position < len(ids):
        size = data.draw(st.integers(min_value=1, max_value=4), label="chunk size")
        step = detokenizer.push(ids[position : position + size])
        position += size
        streamed += step.text_delta
        assert decoded[:end].startswith(streamed)
        if step.stop is not None:
            assert reported is None
            reported = step.stop.stop_string
    streamed += detokenizer.flush()

    assert (streamed, reported) == (decoded[:end], stop)


def test_text_is_not_held_back_as_a_possible_stop_string(tokenizer: PreTrainedTokenizerBase) -> None:
    detokenizer = including(tokenizer, ["ending"])
    streamed = [detokenizer.push([token_id]).text_delta for token_id in tokenizer.encode("The end")]

    # Without the stop string in the output, "end" would wait for the token after it.
    assert streamed[-1].endswith("end") and "".join(streamed) == "The end"
    assert detokenizer.flush() == ""


def test_a_stop_string_begun_in_text_already_streamed_is_found_and_completed(
    tokenizer: PreTrainedTokenizerBase,
) -> None:
    detokenizer = including(tokenizer, ["o wor"])
    steps = [detokenizer.push([token_id]) for token_id in tokenizer.encode("Hello world, said the cat")]

    assert "".join(step.text_delta for step in steps) == "Hello wor"
    assert [step.stop.stop_string for step in steps if step.stop] == ["o wor"]
    assert detokenizer.stopped and detokenizer.flush() == ""


def test_stop_strings_still_apply_only_from_min_tokens_on(tokenizer: PreTrainedTokenizerBase) -> None:
    ids = tokenizer.encode("cat and cat and dog")
    detokenizer = including(tokenizer, ["cat"], min_tokens=2)
    steps = [detokenizer.push([token_id]) for token_id in ids]

    assert "".join(step.text_delta for step in steps) == "cat and cat"

