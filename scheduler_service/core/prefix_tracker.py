"""What one executor's prefix cache is about to hold, beyond what it holds now.

Two sets of prefix-block hashes, counted per request: those of every request placed on the
executor (the router's affinity: they will be computed there), and those being computed right
now by running requests (admission holds back a request whose next prefix block is among them:
within a step or two that block is cached, and waiting for it beats computing it twice).
"""

from collections import Counter
from collections.abc import Sequence

from kv_manager import BlockHash
from scheduler_service.core.request import Request


class _CountedHashes:
    """Hashes contributed by requests, counted, so one request leaving removes only its own."""

    def __init__(self) -> None:
        self._by_request: dict[Request, Sequence[BlockHash]] = {}
        self._counts: Counter[BlockHash] = Counter()

    def __contains__(self, block_hash: BlockHash) -> bool:
        return block_hash in self._counts

    def add(self, request: Request, hashes: Sequence[BlockHash]) -> None:
        self.remove(request)
        if hashes:
            self._by_request[request] = hashes
            self._counts.update(hashes)

    def remove(self, request: Request) -> None:
        counts = self._counts
        for block_hash in self._by_request.pop(request, ()):
            left = counts[block_hash] - 1
            if left:
                counts[block_hash] = left
            else:
                del counts[block_hash]

    def clear(self) -> None:
        self._by_request.clear()
        self._counts.clear()


class PrefixTracker:
    def __init__(self) -> None:
        self.placed = _CountedHashes()
        self.computing = _CountedHashes()

    def leave(self, request: Request) -> None:
        self.placed.remove(request)
        self.computing.remove(request)

    def clear(self) -> None:
        self.placed.clear()
        self.computing.clear()
