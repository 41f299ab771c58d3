"""Log-probabilities in OpenAI's two formats (legacy completions, chat).

The Generation API reports token ids only (TokenLogprob: token_id, logprob, top_token_ids,
top_logprobs); it has no text per token, and per-token text cannot be derived correctly from the
streamed text, which may lag the tokens. Tokens are therefore named as vLLM names them under
--return-tokens-as-token-ids, "token_id:<id>", and `bytes` is null (OpenAI allows null where a
token has no byte form known). Adding each token's bytes to TokenLogprob would let real token
text replace token_name() here and nowhere else.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

from clients.results import GenerationDelta, TokenLogprob

# JSON has no -inf; vLLM clamps to the same value.
LOWEST_LOGPROB = -9999.0


def token_name(token_id: int) -> str:
    return f"token_id:{token_id}"


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

    def fragment(self, delta: GenerationDelta) -> dict[str, Any]:
        records = delta.logprobs
        fragment = {
            "tokens": [token_name(record.token_id) for record in records],
            "token_logprobs": [finite(record.logprob) for record in records],
            "top_logprobs": [_top_dict(record) for record in records],
            "text_offset": [self.offset] * len(records),
        }
        self.offset += len(delta.text)
        return fragment

    def whole(self, deltas: list[GenerationDelta]) -> dict[str, Any]:
        merged: dict[str, list[Any]] = {
            "tokens": [], "token_logprobs": [], "top_logprobs": [], "text_offset": []
        }
        for delta in deltas:
            for key, values in self.fragment(delta).items():
                merged[key].extend(values)
        return merged


def _top_dict(record: TokenLogprob) -> dict[str, float]:
    top = {
        token_name(token_id): finite(logprob)
        for token_id, logprob in zip(record.top_token_ids, record.top_logprobs, strict=True)
    }
    # As vLLM and OpenAI do, the sampled token is always among the entries, even when it is not
    # one of the most likely (or none were asked for).
    top.setdefault(token_name(record.token_id), finite(record.logprob))
    return top


def chat_logprobs(records: list[TokenLogprob]) -> dict[str, Any]:
    """The chat `logprobs` object for these tokens."""
    return {"content": [_chat_token(record) for record in records], "refusal": None}


def _chat_token(record: TokenLogprob) -> dict[str, Any]:
    return {
        "token": token_name(record.token_id),
        "logprob": finite(record.logprob),
        "bytes": None,
        "top_logprobs": [
            {"token": token_name(token_id), "logprob": finite(logprob), "bytes": None}
            for token_id, logprob in zip(record.top_token_ids, record.top_logprobs, strict=True)
        ],
    }
