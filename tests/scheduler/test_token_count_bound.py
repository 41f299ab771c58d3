"""The fewest tokens a text can become, from its length: never more than the tokenizer makes,
for texts built to make the fewest tokens per byte; and no bound at all where none is certain."""

from __future__ import annotations

import copy
from pathlib import Path

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from tokenizers import AddedToken, Tokenizer, models, normalizers, pre_tokenizers
from transformers import AutoTokenizer, PreTrainedTokenizerBase, PreTrainedTokenizerFast

from scheduler_service.text.token_count_bound import token_count_bound
from scheduler_service.text.tokenizer import TextProcessor
from tests.helpers.tokenizer_assets import gpt2_tokenizer_dir, qwen3_tokenizer_dir, sentencepiece_style_tokenizer

MiB = 1 << 20


@pytest.fixture(scope="module")
def qwen3() -> TextProcessor:
    return TextProcessor.from_pretrained(qwen3_tokenizer_dir())


@pytest.fixture(scope="module")
def gpt2(tmp_path_factory: pytest.TempPathFactory) -> TextProcessor:
    return TextProcessor.from_pretrained(gpt2_tokenizer_dir(tmp_path_factory.mktemp("gpt2")))


# Pieces that pack many bytes into one token (Qwen3's and GPT-2's longest entries are runs of
# spaces and dashes), that NFC composes into fewer bytes (an accent after a letter, Hangul jamo,
# the Kelvin and Ångström signs), added tokens, and ordinary text.
PIECES = [
    " " * 128,
    "-" * 128,
    "/" * 64,
    "=" * 80,
    "\n" * 40,
    "e\u0301",
    "\u1100\u1161\u11a8",
    "\u212a",
    "\u212b",
    "\u0390",
    "<|im_end|>",
    "<think>",
    "<|endoftext|>",
    "hello world",
    "你好",
    "🙂",
]
texts = st.lists(st.one_of(st.sampled_from(PIECES), st.text(max_size=8)), max_size=40).map("".join)


@settings(max_examples=300, deadline=None)
@given(text=texts)
def test_the_bound_never_exceeds_the_tokens_made(qwen3: TextProcessor, gpt2: TextProcessor, text: str) -> None:
    for processor in (qwen3, gpt2):
        assert processor.fewest_tokens(text) <= len(processor.encode(text))


@pytest.mark.parametrize("piece", [" ", "-", "ab", "é", "\u212a", "<|im_end|>"])
def test_long_runs_of_one_piece_stay_under_the_tokens_made(qwen3: TextProcessor, gpt2: TextProcessor, piece: str) -> None:
    text = piece * ((64 << 10) // len(piece))
    for processor in (qwen3, gpt2):
        assert processor.fewest_tokens(text) <= len(processor.encode(text))


def test_a_mebibyte_of_ascii_is_at_least_8192_tokens(qwen3: TextProcessor, gpt2: TextProcessor) -> None:
    # Both vocabularies' longest entries are 128 bytes.
    text = "x" * MiB
    assert qwen3.fewest_tokens(text) == gpt2.fewest_tokens(text) == MiB // 128


def test_a_normalizing_tokenizer_counts_only_ascii(qwen3: TextProcessor, gpt2: TextProcessor) -> None:
    text = "é" * 1000 + "a" * 256
    # Qwen3 normalizes (NFC): its é could be composed from fewer bytes; GPT-2 takes bytes as they are.
    assert qwen3.fewest_tokens(text) == 2
    assert gpt2.fewest_tokens(text) == 18  # 2,256 bytes over 128 a token, rounded up


def qwen3_backend() -> tuple[PreTrainedTokenizerBase, Tokenizer]:
    tokenizer = AutoTokenizer.from_pretrained(qwen3_tokenizer_dir())
    return tokenizer, tokenizer.backend_tokenizer


def test_an_added_token_that_strips_whitespace_has_no_bound() -> None:
    tokenizer, backend = qwen3_backend()
    assert token_count_bound(tokenizer) is not None
    # It takes any run of spaces before it into its one token.
    backend.add_special_tokens([AddedToken("<|im_end|>", lstrip=True, normalized=False, special=True)])
    assert token_count_bound(tokenizer) is None


@pytest.mark.parametrize(
    "change",
    [
        # Strip drops characters before any token is made.
        lambda backend: setattr(backend, "normalizer", normalizers.Sequence([normalizers.NFC(), normalizers.Strip()])),
        # Whitespace splitting drops the spaces.
        lambda backend: setattr(
            backend, "pre_tokenizer", pre_tokenizers.Sequence([pre_tokenizers.WhitespaceSplit(), pre_tokenizers.ByteLevel()])
        ),
        # Without ByteLevel, a symbol is a character of any length.
        lambda backend: setattr(backend, "pre_tokenizer", pre_tokenizers.Whitespace()),
    ],
)
def test_steps_that_drop_or_widen_text_have_no_bound(change) -> None:  # type: ignore[no-untyped-def]
    tokenizer, backend = qwen3_backend()
    change(backend)
    assert token_count_bound(tokenizer) is None


def test_other_vocabularies_have_no_bound(tmp_path: Path) -> None:
    # SentencePiece style: '▁' pieces of any length, byte fallback.
    assert token_count_bound(sentencepiece_style_tokenizer()) is None
    # WordPiece: [UNK] stands for a whole word.
    backend = Tokenizer(models.WordPiece({"[UNK]": 0, "a": 1}, unk_token="[UNK]"))
    backend.pre_tokenizer = pre_tokenizers.Whitespace()
    assert token_count_bound(PreTrainedTokenizerFast(tokenizer_object=backend, unk_token="[UNK]")) is None


def test_a_vocabulary_missing_a_byte_has_no_bound() -> None:
    tokenizer, backend = qwen3_backend()
    vocab = copy.deepcopy(backend.get_vocab(with_added_tokens=False))
    vocab.pop("Ġ")  # the space byte
    backend.model = models.BPE(vocab=vocab, merges=[])
    assert token_count_bound(tokenizer) is None
