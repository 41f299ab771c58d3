"""The `suffix` proposer of speculative decoding: continuations the scheduler has seen other
requests generate, falling back to the request's own tokens (prompt lookup, ngram_proposer).

SuffixTable keeps the token sequences of recently finished requests (each one's output, led by
the last LEAD tokens of its prompt so that its first tokens have a context too), indexed
by every run of CONTEXTS tokens in them: the latest occurrence of each wins. A request's last
tokens are looked up longest context first, and the tokens that followed are proposed.

The bound: the sequences held total at most max_tokens tokens (a longer one keeps its tail); when
a new one would pass it, the least recently used (added, or proposed from) go first, and their
index entries with them. So the table holds at most max_tokens tokens (4 bytes each) and at
most len(CONTEXTS) index entries per token (a dict slot, an int key and an int value: about 150
bytes); measured, about 300 bytes per token held, so the default 65,536 tokens come to about
20 MB (tests/scheduler/test_speculation_proposers.py holds it to that). Adding a sequence costs
about a microsecond per token, evictions included. Index keys are hashes of the context, checked
against the stored tokens on every look, so a collision costs a proposal, never a wrong one.

One table serves every executor of the scheduler (the engine's), since requests on any of them
may repeat each other; the planner's lanes share one thread, so it needs no lock.

Which proposal wins: the one with the longer matched context, the request's own on a tie (it is
the same text; the table's is a look-alike).
"""

from collections import OrderedDict
from collections.abc import Iterator, Sequence

import numpy as np

from scheduler_service.core.ngram_proposer import NO_MATCH, Match, NgramProposer
from scheduler_service.core.request import Request

# Context lengths looked up, longest first. Longer than prompt lookup's longest, so that a
# continuation of a long shared run beats a short match in the request's own text.
CONTEXTS = (8, 4)
# Prompt tokens kept before an output: the longest context.
LEAD = CONTEXTS[0]
DEFAULT_MAX_TOKENS = 1 << 16
_END_BITS = 32
_HASH_BASE = np.uint64(0x9E3779B97F4A7C15)


class SuffixTable:
    def __init__(self, max_tokens: int = DEFAULT_MAX_TOKENS) -> None:
        if not 1 <= max_tokens < 1 << _END_BITS:
            raise ValueError(f"max_tokens must be in 1..2^{_END_BITS} - 1, got {max_tokens}")
        self.max_tokens = max_tokens
        # Sequence id -> its tokens, least recently used first.
        self._sequences: OrderedDict[int, np.ndarray] = OrderedDict()
        # Ids of evicted sequences, reused so that ids stay below the most sequences held at once.
        self._free_ids: list[int] = []
        self.num_tokens = 0
        # Per context length: hash of the context -> (sequence id << _END_BITS) | the end of the
        # context in it (exclusive), for its latest occurrence.
        self._index: dict[int, dict[int, int]] = {n: {} for n in CONTEXTS}

    @property
    def num_index_entries(self) -> int:
        return sum(len(index) for index in self._index.values())

    @property
    def num_sequences(self) -> int:
        return len(self._sequences)

    def add(self, tokens: Sequence[int]) -> None:
        """Keeps a sequence (its last max_tokens tokens), evicting the least recently used ones
        until the total fits."""
        if len(tokens) <= min(CONTEXTS):
            return
        array = np.asarray(tokens[-self.max_tokens :], dtype=np.int32)
        while self._sequences and self.num_tokens + len(array) > self.max_tokens:
            self._evict()
        sequence_id = self._free_ids.pop() if self._free_ids else len(self._sequences)
        self._sequences[sequence_id] = array
        self.num_tokens += len(array)
        for n, index in self._index.items():
            index.update(self._entries(sequence_id, array, n))

    def match(self, context: Sequence[int], k: int) -> Match:
        """Up to k tokens that followed the longest of CONTEXTS that ends context, at its latest
        occurrence."""
        for n, index in self._index.items():
            if len(context) < n:
                continue
            tail = np.asarray(context[-n:], dtype=np.int64)
            entry = index.get(int(_context_hashes(tail, n)[0]))
            if entry is None:
                continue
            sequence_id, end = entry >> _END_BITS, entry & ((1 << _END_BITS) - 1)
            sequence = self._sequences[sequence_id]
            if not np.array_equal(sequence[end - n : end], tail):
                continue
            self._sequences.move_to_end(sequence_id)
            return Match(n, sequence[end : end + k].tolist())
        return NO_MATCH

    def _evict(self) -> None:
        sequence_id, array = self._sequences.popitem(last=False)
        self._free_ids.append(sequence_id)
        self.num_tokens -= len(array)
        for n, index in self._index.items():
            for key, entry in self._entries(sequence_id, array, n):
                # Unless a later occurrence took the key over.
                if index.get(key) == entry:
                    del index[key]

    @staticmethod
    def _entries(sequence_id: int, array: np.ndarray, n: int) -> Iterator[tuple[int, int]]:
        """(key, entry) of every context of n tokens in the sequence that a token follows."""
        if len(array) <= n:
            return iter(())
        ends = np.arange(n, len(array), dtype=np.int64)
        keys = _context_hashes(array[:-1], n)
        return zip(keys.tolist(), (ends | sequence_id << _END_BITS).tolist(), strict=True)


def _context_hashes(tokens: np.ndarray, n: int) -> np.ndarray:
    """A hash of each run of n tokens, in order (a polynomial over the tokens, modulo 2^64)."""
    tokens = tokens.astype(np.uint64)
    hashes = np.zeros(len(tokens) - n + 1, dtype=np.uint64)
    for offset in range(n):
        hashes = hashes * _HASH_BASE + tokens[offset : len(tokens) - n + 1 + offset]
    return hashes


class SuffixProposer:
    """Proposes from the table, or from the request's own tokens (see the module docstring)."""

    def __init__(self, table: SuffixTable) -> None:
        self.table = table
        self._own = NgramProposer()

    def propose(self, request: Request, k: int) -> list[int]:
        own = self._own.match(request, k)
        fleet = self.table.match(request.token_ids[-LEAD:], k)
        return (fleet if fleet.length > own.length else own).tokens

    def leave(self, request: Request) -> None:
        """A finished request's output joins the table."""
        self._own.leave(request)
        if request.is_finished and request.num_output_tokens:
            self.table.add(request.token_ids[max(0, request.num_prompt_tokens - LEAD) :])
