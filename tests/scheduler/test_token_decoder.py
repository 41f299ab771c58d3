"""The detokenizer's window decode (text/token_decoder.py) gives exactly what the tokenizer's
decode() gives, for the real tokenizers it takes the short way with and for one it must not:
random windows of ids, special tokens among them, with and without skip_special_tokens."""

import random
from pathlib import Path

import pytest
from transformers import AutoTokenizer, PreTrainedTokenizerBase

from scheduler_service.text.token_decoder import backend_decode_is_exact, token_decoder
from tests.helpers.tokenizer_assets import (
    gpt2_tokenizer_dir,
    qwen3_tokenizer_dir,
    sentencepiece_style_tokenizer,
)


def _tokenizers(tmp_path: Path) -> dict[str, PreTrainedTokenizerBase]:
    cleaned = AutoTokenizer.from_pretrained(gpt2_tokenizer_dir(tmp_path / "gpt2-cleaned"))
    cleaned.clean_up_tokenization_spaces = True
    return {
        "qwen3": AutoTokenizer.from_pretrained(qwen3_tokenizer_dir()),
        "gpt2": AutoTokenizer.from_pretrained(gpt2_tokenizer_dir(tmp_path / "gpt2")),
        "sentencepiece": sentencepiece_style_tokenizer(),
        # Asks decode() for its clean-up of tokenization spaces: not the short way.
        "gpt2-cleaned": cleaned,
    }


@pytest.mark.parametrize("skip_special_tokens", [True, False])
def test_windows_decode_as_the_tokenizer_decodes_them(tmp_path: Path, skip_special_tokens: bool) -> None:
    rng = random.Random(7)
    tokenizers = _tokenizers(tmp_path)
    assert [name for name, tokenizer in tokenizers.items() if backend_decode_is_exact(tokenizer)] == [
        "qwen3", "gpt2", "sentencepiece"
    ]
    for name, tokenizer in tokenizers.items():
        decode = token_decoder(tokenizer, skip_special_tokens)
        text = "Hello, world! Ça va? 東京 🚀 the end.\n  x = [1, 2]  ."
        ids = tokenizer.encode(text, add_special_tokens=False)
        specials = tokenizer.all_special_ids
        for _ in range(200):
            window = [
                rng.choice(ids + specials) if rng.random() < 0.8 else rng.randrange(len(tokenizer))
                for _ in range(rng.randint(1, 8))
            ]
            expected = tokenizer.decode(window, skip_special_tokens=skip_special_tokens)
            assert decode(window) == expected, (name, window)
