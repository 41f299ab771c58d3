"""One constrained request's place in its grammar: an xgrammar matcher and the buffer its masks
are filled into."""

from collections.abc import Iterable, Sequence
from typing import Any


class GrammarState:
    """A TokenConstraint over xgrammar. Made from the request's output so far, so a planner
    that takes a request over (after a failover, a preemption or its own restart) carries on
    from where the grammar stood."""

    __slots__ = ("_matcher", "_bitmask")

    def __init__(self, xgr: Any, compiled: Any, stop_token_ids: Iterable[int], vocab_size: int) -> None:
        self._matcher = xgr.GrammarMatcher(compiled, override_stop_tokens=sorted(stop_token_ids))
        self._bitmask = xgr.allocate_token_bitmask(1, vocab_size)

    def accept(self, token_id: int) -> bool:
        return bool(self._matcher.accept_token(token_id))

    def allowed_token_bitmask(self) -> bytes:
        self._matcher.fill_next_token_bitmask(self._bitmask, 0)
        return self._bitmask.numpy().tobytes()

    def draft_bitmasks(self, drafts: Sequence[int]) -> list[bytes]:
        masks = [self.allowed_token_bitmask()]
        taken = 0
        for token in drafts:
            if not self._matcher.accept_token(token):
                break
            taken += 1
            if self._matcher.is_terminated():
                # A draft that ends the sentence stays out: no position follows it to mask, and
                # the token sampled where it stands may be it all the same.
                break
            masks.append(self.allowed_token_bitmask())
        if taken:
            self._matcher.rollback(taken)
        return masks

    @property
    def is_terminated(self) -> bool:
        """The grammar's sentence is complete and its end-of-sequence was accepted."""
        return bool(self._matcher.is_terminated())
