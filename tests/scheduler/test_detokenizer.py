"""IncrementalDetokenizer against real tokenizers: streamed text equals a full decode, no broken
characters are streamed, and no part of a stop string ever leaves."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from transformers import AutoTokenizer, PreTrainedTokenizerBase

from scheduler_service.text.detokenizer import (
    DetokenizerStep,
    IncrementalDetokenizer,
    StringStop,
)
from scheduler_service.text.token_bytes import TokenBytes
from tests.helpers.tokenizer_assets import (
    gpt2_tokenizer_dir,
    qwen3_tokenizer_dir,
    sentencepiece_style_tokenizer,
    smollm2_gguf,
)

TOKENIZERS = ["gpt2", "qwen3", "smollm2", "sentencepiece"]
PROMPTS = ["", "Hello", "The answer is:", "Ein Gedicht über"]
# Text with characters of 1 to 4 UTF-8 bytes, which byte-level tokenizers split across tokens.
MULTIBYTE_ALPHABET = "ab ,.é中文字😀🎉🇫🇷ऋ\n"
SAMPLE_TEXTS = ["Hello world, 世界! 😀🎉 naïve café — 日本語のテキスト 🇫🇷", "STOP stop\n\nend"]
PROPERTY_SETTINGS = settings(
    max_examples=60, deadline=None, suppress_health_check=[HealthCheck.too_slow]
)


def _load(name: str, tmp_path: Path) -> PreTrainedTokenizerBase:
    if name == "gpt2":
        return AutoTokenizer.from_pretrained(gpt2_tokenizer_dir(tmp_path / "gpt2"))
    if name == "qwen3":
        return AutoTokenizer.from_pretrained(qwen3_tokenizer_dir())
    if name == "smollm2":
        folder, gguf_file = smollm2_gguf()
        return AutoTokenizer.from_pretrained(folder, gguf_file=gguf_file)
    return sentencepiece_style_tokenizer()


@dataclass(slots=True, frozen=True)
class TokenizerCase:
    name: str
    tokenizer: PreTrainedTokenizerBase

    def __repr__(self) -> str:
        return self.name


@pytest.fixture(scope="module", params=TOKENIZERS)
def case(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory) -> TokenizerCase:
    return TokenizerCase(request.param, _load(request.param, tmp_path_factory.mktemp("tokenizer")))


@pytest.fixture(scope="module")
def gpt2(tmp_path_factory: pytest.TempPathFactory) -> PreTrainedTokenizerBase:
    return _load("gpt2", tmp_path_factory.mktemp("gpt2"))


def _interesting_ids(tokenizer: PreTrainedTokenizerBase) -> list[int]:
    """Ids that stress the detokenizer: pieces of multi-byte characters and special tokens."""
    ids = set(tokenizer.all_special_ids)
    for text in SAMPLE_TEXTS:
        ids.update(tokenizer.encode(text, add_special_tokens=False))
    return sorted(ids)


def _token_ids(case: TokenizerCase, max_size: int) -> st.SearchStrategy[list[int]]:
    tokenizer = case.tokenizer
    if case.name == "sentencepiece":
        # Byte tokens only as whole characters (see sentencepiece_style_tokenizer).
        byte_ids = set(tokenizer.convert_tokens_to_ids([f"<0x{b:02X}>" for b in range(256)]))
        pieces = [i for i in range(len(tokenizer)) if i not in byte_ids]
        units = st.one_of(
            st.sampled_from(pieces).map(lambda i: [i]),
            st.characters(min_codepoint=0x80, codec="utf-8").map(
                lambda c: tokenizer.convert_tokens_to_ids([f"<0x{b:02X}>" for b in c.encode()])
            ),
        )
        return st.lists(units, max_size=max_size // 2).map(lambda u: [i for ids in u for i in ids])
    any_id = st.integers(min_value=0, max_value=len(tokenizer) - 1)
    interesting = st.sampled_from(_interesting_ids(tokenizer))
    return st.lists(st.one_of(interesting, any_id), max_size=max_size)


def _chunks(data: st.DataObject, ids: Sequence[int]) -> list[list[int]]:
    chunks, start = [], 0
    while start < len(ids):
        size = data.draw(st.integers(min_value=1, max_value=4), label="chunk size")
        chunks.append(list(ids[start : start + size]))
        start += size
    return chunks


def _stream(
    detokenizer: IncrementalDetokenizer, chunks: Sequence[Sequence[int]]
) -> list[DetokenizerStep]:
    return [detokenizer.push(chunk) for chunk in chunks]


def test_gpt2_tokenizer_is_the_real_one(gpt2: PreTrainedTokenizerBase) -> None:
    assert gpt2.encode("Hello world") == [15496, 995]


@PROPERTY_SETTINGS
@given(data=st.data())
def test_streamed_text_equals_full_decode(case: TokenizerCase, data: st.DataObject) -> None:
    tokenizer = case.tokenizer
    skip_special_tokens = data.draw(st.booleans(), label="skip special tokens")
    prompt_ids = tokenizer.encode(data.draw(st.sampled_from(PROMPTS)), add_special_tokens=False)
    output_ids = data.draw(_token_ids(case, max_size=40), label="output ids")
    detokenizer = IncrementalDetokenizer(tokenizer, prompt_ids, skip_special_tokens, stop=[])

    steps = _stream(detokenizer, _chunks(data, output_ids))
    streamed = "".join(step.text_delta for step in steps) + detokenizer.flush()

    prompt_text = tokenizer.decode(prompt_ids, skip_special_tokens=skip_special_tokens)
    full_text = tokenizer.decode(prompt_ids + output_ids, skip_special_tokens=skip_special_tokens)
    assert full_text.startswith(prompt_text)
    expected = full_text[len(prompt_text) :]
    # All of it, but for the replacement characters of a last character cut off unfinished.
    assert expected.startswith(streamed) and set(expected[len(streamed) :]) <= {"\ufffd"}
    assert all(step.stop is None for step in steps)


@PROPERTY_SETTINGS
@given(data=st.data())
def test_multibyte_text_never_streams_a_broken_character(
    case: TokenizerCase, data: st.DataObject
) -> None:
    tokenizer = case.tokenizer
    text = data.draw(st.text(alphabet=MULTIBYTE_ALPHABET, min_size=1, max_size=30), label="text")
    ids = tokenizer.encode(text, add_special_tokens=False)
    detokenizer = IncrementalDetokenizer(tokenizer, [], skip_special_tokens=True)

    deltas = [step.text_delta for step in _stream(detokenizer, _chunks(data, ids))]

    assert not any("\ufffd" in delta for delta in deltas)
    assert "".join(deltas) + detokenizer.flush() == tokenizer.decode(ids)


def _first_stop(text: str, stops: Sequence[str]) -> tuple[int, str] | None:
    """Reference: the stop string whose first occurrence ends first (ties: starts first)."""
    found = [(text.find(s) + len(s), text.find(s), s) for s in stops if s in text]
    if not found:
        return None
    _, position, stop = min(found, key=lambda match: match[:2])
    return position, stop


@PROPERTY_SETTINGS
@given(data=st.data())
def test_stop_strings_are_caught_across_tokens_and_never_streamed(
    case: TokenizerCase, data: st.DataObject
) -> None:
    tokenizer = case.tokenizer
    text = data.draw(st.text(alphabet=MULTIBYTE_ALPHABET, min_size=2, max_size=30), label="text")
    ids = tokenizer.encode(text, add_special_tokens=False)
    decoded = tokenizer.decode(ids)
    start = data.draw(st.integers(min_value=0, max_value=len(decoded) - 1), label="stop start")
    length = data.draw(st.integers(min_value=1, max_value=6), label="stop length")
    decoy = data.draw(st.text(MULTIBYTE_ALPHABET, min_size=1, max_size=4), label="decoy stop")
    stops = [decoded[start : start + length], decoy]
    position, stop = _first_stop(decoded, stops) or (len(decoded), None)
    expected = decoded[:position]
    detokenizer = IncrementalDetokenizer(tokenizer, [], skip_special_tokens=True, stop=stops)

    streamed = ""
    reported = None
    # Output tokens: those of the chunks up to the stop, and of its chunk those it keeps.
    kept = 0
    chunks = _chunks(data, ids)
    for chunk, step in zip(chunks, _stream(detokenizer, chunks), strict=True):
        streamed += step.text_delta
        # Whatever left must be text before the stop string.
        assert expected.startswith(streamed)
        if step.stop is not None:
            assert reported is None
            reported = step.stop.stop_string
            kept += step.stop.num_tokens
        elif reported is None:
            kept += len(chunk)
    streamed += detokenizer.flush()

    assert streamed == expected
    assert reported == stop
    assert detokenizer.stopped == (stop is not None)
    # However the tokens were grouped, the output ends on the token it ends on one at a time.
    one_at_a_time = IncrementalDetokenizer(tokenizer, [], skip_special_tokens=True, stop=stops)
    ends = (count for count, token in enumerate(ids, start=1) if one_at_a_time.push([token]).stop is not None)
    assert kept == next(ends, len(ids))


def test_stop_string_split_over_tokens(gpt2: PreTrainedTokenizerBase) -> None:
    ids = gpt2.encode("Hello world, said the cat")
    detokenizer = IncrementalDetokenizer(gpt2, [], skip_special_tokens=True, stop=["o wor"])
    steps = [detokenizer.push([token_id]) for token_id in ids]

    assert [step.text_delta for step in steps[:2]] == ["Hell", ""]
    assert steps[1].stop == StringStop("o wor", 1)
    # After the stop, nothing more comes out.
    assert all(step == DetokenizerStep("") for step in steps[2:])
    assert detokenizer.flush() == ""


def test_stop_strings_apply_only_from_min_tokens_on(gpt2: PreTrainedTokenizerBase) -> None:
    ids = gpt2.encode("cat and cat and dog")
    detokenizer = IncrementalDetokenizer(gpt2, [], skip_special_tokens=True, stop=["cat"], min_tokens=2)
    steps = [detokenizer.push([token_id]) for token_id in ids]

    # The first "cat" falls within the first two tokens and is output; the second one stops.
    assert "".join(step.text_delta for step in steps) == "cat and "
    assert [step.stop.stop_string for step in steps if step.stop] == ["cat"]


def test_held_back_text_is_released_when_the_stop_string_does_not_follow(
    gpt2: PreTrainedTokenizerBase,
) -> None:
    detokenizer = IncrementalDetokenizer(gpt2, [], skip_special_tokens=True, stop=["ending"])
    streamed = [detokenizer.push([token_id]).text_delta for token_id in gpt2.encode("The end")]

    assert "".join(streamed) == "The "
    assert detokenizer.flush() == "end"


def test_first_output_token_keeps_its_leading_space_after_the_prompt() -> None:
    tokenizer = sentencepiece_style_tokenizer()
    vocab = tokenizer.get_vocab()
    detokenizer = IncrementalDetokenizer(tokenizer, [vocab["▁Hello"]], skip_special_tokens=True)

    assert detokenizer.push([vocab["▁world"]]).text_delta == " world"


def test_special_tokens_are_skipped_or_kept(gpt2: PreTrainedTokenizerBase) -> None:
    ids = [15496, gpt2.eos_token_id, 995]
    skipping = IncrementalDetokenizer(gpt2, [], skip_special_tokens=True)
    keeping = IncrementalDetokenizer(gpt2, [], skip_special_tokens=False)

    assert skipping.push(ids).text_delta + skipping.flush() == "Hello world"
    assert keeping.push(ids).text_delta + keeping.flush() == "Hello<|endoftext|> world"


def test_window_stays_small_over_a_long_output(gpt2: PreTrainedTokenizerBase) -> None:
    ids = gpt2.encode("The quick brown fox jumps over the lazy dog. 世界😀 " * 40)
    detokenizer = IncrementalDetokenizer(gpt2, [], skip_special_tokens=True)
    streamed = ""
    longest_window = 0
    for token_id in ids:
        streamed += detokenizer.push([token_id]).text_delta
        longest_window = max(longest_window, len(detokenizer._window))
    assert streamed + detokenizer.flush() == gpt2.decode(ids)
    assert longest_window <= 10


def test_unending_invalid_bytes_do_not_grow_the_window(gpt2: PreTrainedTokenizerBase) -> None:
    # A lone UTF-8 lead byte (0xF0) never completes: the output is invalid bytes.
    lead_byte = gpt2.convert_tokens_to_ids("ð")
    detokenizer = IncrementalDetokenizer(gpt2, [], skip_special_tokens=True)
    streamed = "".join(detokenizer.push([lead_byte]).text_delta for _ in range(200))

    assert len(detokenizer._window) <= 80
    assert set(streamed) == {"\ufffd"}


def test_a_character_cut_off_by_the_end_of_the_output_is_dropped_not_replaced(
    gpt2: PreTrainedTokenizerBase,
) -> None:
    """The output ends inside a multi-byte character (max_tokens reached): the final text ends
    before that character, with no U+FFFD, and is what was streamed plus the flush."""
    ids = gpt2.encode("Good morning: 早上好", add_special_tokens=False)
    cuts = 0
    for end in range(1, len(ids) + 1):
        text = gpt2.decode(ids[:end])
        cuts += text.endswith("\ufffd")
        detokenizer = IncrementalDetokenizer(gpt2, [], skip_special_tokens=True)
        streamed = "".join(detokenizer.push([token]).text_delta for token in ids[:end])
        assert streamed + detokenizer.flush() == text.rstrip("\ufffd"), end
    assert cuts >= 2



def _is_whole_text(raw: bytes) -> bool:
    try:
        raw.decode("utf-8")
    except UnicodeDecodeError:
        return False
    return True


@pytest.mark.parametrize("source", ["gpt2", "qwen3", "sentencepiece"])
def test_token_bytes_spell_the_text_exactly(source: str, tmp_path: Path) -> None:
    """Each token's bytes, for logprobs: together they are the text's UTF-8 bytes, even where
    one token holds only part of a character (CJK in GPT-2's vocabulary, byte fallback)."""
    tokenizer = {
        "gpt2": lambda: AutoTokenizer.from_pretrained(gpt2_tokenizer_dir(tmp_path / "gpt2")),
        "qwen3": lambda: AutoTokenizer.from_pretrained(qwen3_tokenizer_dir()),
        "sentencepiece": sentencepiece_style_tokenizer,
    }[source]()
    text = "Hello world\n é 你好, naïve café!"
    ids = tokenizer.encode(text, add_special_tokens=False)
    token_bytes = TokenBytes(tokenizer)
    pieces = [token_bytes(token) for token in ids]
    # SentencePiece marks the start of the text with a space its decoder strips.
    assert b"".join(pieces).removeprefix(b" " if source == "sentencepiece" else b"") == text.encode()
    if source == "gpt2":
        assert not all(_is_whole_text(piece) for piece in pieces)
