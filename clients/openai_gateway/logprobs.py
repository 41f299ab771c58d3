"""Log-probabilities in OpenAI's two formats (legacy completions, chat).

The scheduler reports each token's bytes (TokenLogprob.token_bytes) when it has a tokenizer. A
token's text is its bytes decoded; a token that holds part of a UTF-8 character is named as
OpenAI names one, "bytes:" and its bytes escaped ("bytes:\\xe4\\xbd"), with `bytes` the exact
list. Without a tokenizer, tokens are named as vLLM names them under
--return-tokens-as-token-ids, "token_id:<id>", and `bytes` is null.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

from clients.results import GenerationDelta, TokenLogprob

# JSON has no -inf; vLLM clamps to the same value.
LOWEST_LOGPROB = -9999.0


def token_name(token_id: int, token_bytes: bytes | None) -> str:
    if token_bytes is None:
        return f"token_id:{token_id}"
    try:
        return token_bytes.decode("utf-8")
    except UnicodeDecodeError:
        return "bytes:" + "".join(f"\\x{byte:02x}" for byte in token_bytes)


def byte_list(token_bytes: bytes | None) -> list[int] | None:
    return list(token_bytes) if token_bytes is not None else None


def _top(record: TokenLogprob) -> list[tuple[int, bytes | None, float]]:
    """(id, bytes, logprob) of each top token."""
    top_bytes: list[bytes | None] = list(record.top_token_bytes) or [None] * len(record.top_token_ids)
    return list(zip(record.top_token_ids, top_bytes, record.top_logprobs, strict=True))


def finite(logprob: float) -> float:
    return logprob if math.isfinite(logprob) else LOWEST_LOGPROB


@dataclass(slots=True)
class CompletionLogprobs:
    """The completions `logprobs` object, one fragment per streamed delta.

    text_offset is where, in the completion text, the text released with a token's message
    begins: each token's own offset when the server releases every token's text with it (the
    usual case), the start of the held-back span for tokens whose text it held back (an
    incomplete character, a possible stop string).
    """

    offset: int = 0
    # With echo: the prompt's first token, which nothing scores (its entries are null), until
    # the fragment that leads with the prompt.
    echo_first: TokenLogprob | None = None
    # The echoed prompt's length in characters: where the completion's text begins.
    echo_length: int = 0

    def fragment(self, delta: GenerationDelta) -> dict[str, Any]:
        fragment: dict[str, list[Any]] = {"tokens": [], "token_logprobs": [], "top_logprobs": [], "text_offset": []}
        if self.echo_first is not None:
            first, self.echo_first = self.echo_first, None
            fragment = {
                "tokens": [token_name(first.token_id, first.token_bytes)],
                "token_logprobs": [None],
                "top_logprobs": [None],
                "text_offset": [0],
            }
            self.offset = len(fragment["tokens"][0])
            for record in delta.prompt_logprobs:
                self._add(fragment, record)
                self.offset += len(token_name(record.token_id, record.token_bytes))
            self.offset = self.echo_length
        for record in delta.logprobs:
            self._add(fragment, record)
        self.offset += len(delta.text)
        return fragment

    def _add(self, fragment: dict[str, list[Any]], record: TokenLogprob) -> None:
        fragment["tokens"].append(token_name(record.token_id, record.token_bytes))
        fragment["token_logprobs"].append(finite(record.logprob))
        fragment["top_logprobs"].append(_top_dict(record))
        fragment["text_offset"].append(self.offset)

    def whole(self, deltas: list[GenerationDelta]) -> dict[str, Any]:
        merged: dict[str, list[Any]] = {
            "tokens": [], "token_logprobs": [], "top_logprobs": [], "text_offset": []
        }
        for delta in deltas:
            for key, values in self.fragment(delta).items():
                merged[key].extend(values)
        return merged


def _top_dict(record: TokenLogprob) -> dict[str, float]:
    top = {token_name(token_id, raw): finite(logprob) for token_id, raw, logprob in _top(record)}
    # As vLLM and OpenAI do, the sampled token is always among the entries, even when it is not
    # one of the most likely (or none were asked for).
    top.setdefault(token_name(record.token_id, record.token_bytes), finite(record.logprob))
    return top


def chat_logprobs(records: list[TokenLogprob]) -> dict[str, Any]:
    """The chat `logprobs` object for these tokens."""
    return {"content": [_chat_token(record) for record in records], "refusal": None}


def _chat_token(record: TokenLogprob) -> dict[str, Any]:
    return {
        "token": token_name(record.token_id, record.token_bytes),
        "logprob": finite(record.logprob),
        "bytes": byte_list(record.token_bytes),
        "top_logprobs": [
            {"token": token_name(token_id, raw), "logprob": finite(logprob), "bytes": byte_list(raw)}
            for token_id, raw, logprob in _top(record)
        ],
    }
