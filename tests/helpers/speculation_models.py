"""Next-token functions for the simulated executor (core/sim_executor.py) that make speculative
decoding's drafts right or wrong as a test needs, and the reference they must agree with: the
tokens of decoding one at a time. Each is a pure function of the tokens, as a model is."""

from __future__ import annotations

import zlib
from collections.abc import Sequence

from scheduler_service.core.sim_executor import TokenFn


def echo(period: int, every: int = 13) -> TokenFn:
    """Repeats the token `period` positions back (a model quoting its prompt), except at every
    `every`-th position, where it says something new (a draft across it is rejected)."""

    def next_token(request_id: str, token_ids: Sequence[int]) -> int:
        n = len(token_ids)
        if n % every == 0 or n < period:
            return (sum(token_ids[-4:]) * 31 + n) % 1000 + 3
        return token_ids[n - period]

    return next_token


def babble(alphabet: int) -> TokenFn:
    """A hash of the last tokens and the position into a small alphabet: its n-grams recur, so
    prompt lookup proposes, and its proposals are right about once in `alphabet`."""

    def next_token(request_id: str, token_ids: Sequence[int]) -> int:
        key = ",".join(map(str, [len(token_ids), *token_ids[-3:]])).encode()
        return 10 + zlib.crc32(key) % alphabet

    return next_token


def recite(text: Sequence[int]) -> TokenFn:
    """Recites `text` on from the token after the last one it said; from its start after any
    token not in it (so every request recites the same answer, whatever its prompt)."""
    position = {token: index for index, token in enumerate(text)}

    def next_token(request_id: str, token_ids: Sequence[int]) -> int:
        index = position.get(token_ids[-1])
        return text[0] if index is None else text[(index + 1) % len(text)]

    return next_token


def decode_one_at_a_time(next_token: TokenFn, prompt: Sequence[int], count: int) -> list[int]:
    tokens = list(prompt)
    for _ in range(count):
        tokens.append(next_token("reference", tokens))
    return tokens[len(prompt) :]
