"""Prompt lookup (the `ngram` proposer of speculative decoding): a request's next tokens guessed
from its own tokens.

The longest suffix of the request's tokens, from MAX_NGRAM tokens down to MIN_NGRAM, that
occurred earlier in them is found; the tokens that followed its latest earlier occurrence are
proposed. Where that occurrence ends within MAX_NGRAM tokens of the end (a run, a short period)
the proposal goes on through itself, so a repeated pattern is continued rather than cut short.

Each request's tokens are kept here as an array, extended by the tokens it gained since the last
look (never copied whole again), so a look costs one vector comparison over the tokens and a few
over the candidates it finds. `leave` drops a request's array.
"""

from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np

from scheduler_service.core.request import Request

# A suffix of one token matches almost anywhere in a long text; two are the least that says
# something about what follows.
MIN_NGRAM = 2
MAX_NGRAM = 4


@dataclass(slots=True)
class Match:
    """A proposal and the length of the context it matched (its evidence)."""

    length: int
    tokens: list[int]


NO_MATCH = Match(0, [])


def lookup(tokens: np.ndarray, k: int, max_n: int = MAX_NGRAM, min_n: int = MIN_NGRAM) -> Match:
    """Up to k tokens to follow `tokens`, from the latest earlier occurrence of its longest
    suffix of min_n..max_n tokens."""
    length = len(tokens)
    if k <= 0 or length <= min_n:
        return NO_MATCH
    # Candidate ends (exclusive) of earlier occurrences: where the last token occurred before.
    ends = np.flatnonzero(tokens[: length - 1] == tokens[length - 1]) + 1
    if not ends.size:
        return NO_MATCH
    matched = np.ones(ends.size, dtype=np.int64)
    alive = np.ones(ends.size, dtype=bool)
    for back in range(1, min(max_n, length)):
        before = ends - 1 - back
        alive &= before >= 0
        alive[alive] = tokens[before[alive]] == tokens[length - 1 - back]
        if not alive.any():
            break
        matched += alive
    best = int(matched.max())
    if best < min_n:
        return NO_MATCH
    end = int(ends[np.flatnonzero(matched == best)[-1]])
    proposal = tokens[end : end + k].tolist()
    # Past the known tokens the continuation reads its own proposal: a period shorter than k
    # repeats.
    while len(proposal) < k:
        proposal.append(proposal[len(proposal) - (length - end)])
    return Match(best, proposal)


class TokenArrays:
    """Each request's tokens as an array, extended as it gains tokens."""

    def __init__(self) -> None:
        self._arrays: dict[Request, tuple[np.ndarray, int]] = {}

    def of(self, request: Request) -> np.ndarray:
        """The request's tokens (a view, valid until its next call)."""
        tokens: Sequence[int] = request.token_ids
        array, size = self._arrays.get(request, (np.zeros(0, dtype=np.int64), 0))
        if len(tokens) > size:
            if len(tokens) > len(array):
                grown = np.zeros(max(64, 2 * len(tokens)), dtype=np.int64)
                grown[:size] = array[:size]
                array = grown
            array[size : len(tokens)] = tokens[size:]
            size = len(tokens)
            self._arrays[request] = (array, size)
        return array[:size]

    def leave(self, request: Request) -> None:
        self._arrays.pop(request, None)

    def __len__(self) -> int:
        return len(self._arrays)


class NgramProposer:
    """Proposes from the request's own tokens (see the module docstring)."""

    def __init__(self) -> None:
        self.arrays = TokenArrays()

    def match(self, request: Request, k: int) -> Match:
        return lookup(self.arrays.of(request), k)

    def propose(self, request: Request, k: int) -> list[int]:
        return self.match(request, k).tokens

    def leave(self, request: Request) -> None:
        self.arrays.leave(request)
