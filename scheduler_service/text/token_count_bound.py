"""How many tokens a text becomes at the least, from its length alone: a prompt that certainly
cannot fit the model is refused before a second of tokenizing, not after.

Certain only where every token stands for a bounded stretch of the text, which holds for
byte-level BPE (GPT-2, Llama 3, Qwen, SmolLM2): the text's bytes, once normalized, are split
among tokens that are each a vocabulary entry of at most `longest` bytes, or an added token's
string. A normalizer may change the bytes (NFC composes 'e' and an accent into one 'é', and
the Unicode version decides which); what Unicode normalization and lowercasing do to ASCII,
though, is fixed for every version (ASCII_PRESERVING_NORMALIZERS), so a normalizing tokenizer's
text is counted by its ASCII characters only. Elsewhere no bound is claimed: a WordPiece [UNK] can stand for a whole word,
and an added token that strips whitespace for any run of it.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from tokenizers import Tokenizer, models

if TYPE_CHECKING:
    from transformers import PreTrainedTokenizerBase

# Normalizers that keep every ASCII character one byte and drop none: an ASCII character is left
# as it is, or lowercased, or composed with the marks after it into a character of two bytes or
# more that holds no other ASCII character.
ASCII_PRESERVING_NORMALIZERS = frozenset({"NFC", "NFD", "NFKC", "NFKD", "Lowercase"})
# Pre-tokenizers that only cut the text into pieces, unless told to drop what they cut at
# (behavior "Removed"); Whitespace, Metaspace and the like drop or replace characters.
CUTTING_PRE_TOKENIZERS = frozenset({"Split", "Digits", "Punctuation", "UnicodeScripts"})


@dataclass(slots=True, frozen=True)
class TokenCountBound:
    # The most bytes of text one token stands for.
    bytes_per_token: int
    # Whether the tokenizer normalizes its input: then only ASCII characters are counted.
    normalizes: bool

    def fewest_tokens(self, text: str) -> int:
        if text.isascii():
            counted = len(text)
        elif self.normalizes:
            counted = len(text.encode("ascii", "ignore"))
        else:
            counted = len(text.encode())
        return -(-counted // self.bytes_per_token)


def token_count_bound(tokenizer: PreTrainedTokenizerBase) -> TokenCountBound | None:
    """The bound for this tokenizer, or None where none is certain."""
    # Imported here: a front-end rules torch out before transformers first loads
    # (process/torch_free.py).
    from transformers.convert_slow_tokenizer import bytes_to_unicode

    backend = getattr(tokenizer, "backend_tokenizer", None)
    if not isinstance(backend, Tokenizer) or not isinstance(backend.model, models.BPE):
        return None
    if backend.pre_tokenizer is None or not _keeps_every_byte(_parts(backend.pre_tokenizer, "pretokenizers")):
        return None
    normalizes = backend.normalizer is not None
    if normalizes and not all(
        part["type"] in ASCII_PRESERVING_NORMALIZERS for part in _parts(backend.normalizer, "normalizers")
    ):
        return None
    added = backend.get_added_tokens_decoder().values()
    if any(token.lstrip or token.rstrip for token in added):
        return None
    vocab = backend.get_vocab(with_added_tokens=False)
    # A byte missing from the vocabulary would be dropped from the text, standing for no token.
    if not set(bytes_to_unicode().values()) <= vocab.keys():
        return None
    # Each symbol of a byte-level entry is one byte (a subword prefix or suffix only adds
    # symbols, which makes the bound looser, never wrong).
    longest = max(
        max(map(len, vocab), default=1), max((len(token.content.encode()) for token in added), default=1)
    )
    return TokenCountBound(bytes_per_token=longest, normalizes=normalizes)


def _keeps_every_byte(parts: list[dict[str, Any]]) -> bool:
    """Whether the pre-tokenizer maps every byte of the text to one symbol (ByteLevel) and
    otherwise only cuts the text, dropping nothing."""
    kinds = {part["type"] for part in parts}
    return (
        "ByteLevel" in kinds
        and kinds <= CUTTING_PRE_TOKENIZERS | {"ByteLevel"}
        and all(part.get("behavior") != "Removed" for part in parts)
    )


def _parts(component: object, members: str) -> list[dict[str, Any]]:
    """A normalizer's or pre-tokenizer's steps, from its serialized form (the Python classes do
    not expose a Sequence's members); a Sequence within a Sequence stays one opaque step."""
    state = json.loads(component.__getstate__())  # type: ignore[attr-defined]
    return list(state[members]) if state["type"] == "Sequence" else [state]
