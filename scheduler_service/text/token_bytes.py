"""The bytes of one token's text, for logprobs: OpenAI reports each token's text and bytes, and
a token of a byte-level vocabulary may hold part of a UTF-8 character, so bytes are the exact
form and text is derived from them.

Two vocabulary families cover the tokenizers transformers loads:
- byte-level BPE (GPT-2, Llama 3, Qwen, SmolLM2): each symbol of a vocabulary entry stands for
  one byte, through GPT-2's byte-to-unicode table;
- SentencePiece style (Llama 2, Mistral): '▁' is a space and '<0xNN>' a byte-fallback byte.
Special tokens are their own text. Anything else is decoded alone, which is right for every
token that holds whole characters.
"""

from __future__ import annotations

import re
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from transformers import PreTrainedTokenizerBase

BYTE_FALLBACK = re.compile(r"<0x([0-9A-Fa-f]{2})>")


class TokenBytes:
    """token id -> bytes, remembered per id (a vocabulary is bounded)."""

    def __init__(self, tokenizer: PreTrainedTokenizerBase) -> None:
        # Imported here: a front-end rules torch out before transformers first loads
        # (process/torch_free.py).
        from transformers.convert_slow_tokenizer import bytes_to_unicode

        self._tokenizer = tokenizer
        self._special = {i: t.content for i, t in tokenizer.added_tokens_decoder.items()}
        decoder = repr(getattr(getattr(tokenizer, "backend_tokenizer", None), "decoder", None))
        self._byte_level = decoder.startswith("ByteLevel")
        self._metaspace = "▁" in decoder or "Metaspace" in decoder
        self._unicode_to_byte = {symbol: byte for byte, symbol in bytes_to_unicode().items()}
        self._known: dict[int, bytes] = {}

    def __call__(self, token_id: int) -> bytes:
        known = self._known.get(token_id)
        if known is None:
            known = self._known[token_id] = self._bytes(token_id)
        return known

    def _bytes(self, token_id: int) -> bytes:
        if token_id in self._special:
            return self._special[token_id].encode()
        piece = self._tokenizer.convert_ids_to_tokens(token_id)
        if piece is None:
            return b""
        if self._byte_level and all(symbol in self._unicode_to_byte for symbol in piece):
            return bytes(self._unicode_to_byte[symbol] for symbol in piece)
        if self._metaspace:
            if match := BYTE_FALLBACK.fullmatch(piece):
                return bytes([int(match.group(1), 16)])
            return piece.replace("▁", " ").encode()
        return self._tokenizer.decode([token_id]).encode()
