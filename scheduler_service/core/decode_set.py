"""The running requests of one executor that are in steady decode, held as arrays so that a step
plans them, and applies their tokens, in bulk.

A steady decode computes one token, the one sampled last, and samples the next. Listing each as
a plan entry and answering each with a result record costs microseconds per request per step in
Python; here a step costs a few array operations plus one tight loop that appends each token to
its request. On the wire these decodes are a packed list of handles (NewRequest.handle) and come
back as a packed list of tokens in the same order.

A request joins once its prefill is done, when nothing about it needs per-request care (no
logprobs, no stop token ids, no min_tokens, not retried after a failed step). It leaves when it
finishes, is preempted or its executor goes. While it is here these arrays are the only home of
its progress (computed tokens, pending outputs, time of its last token): join and leave move it
(Request.move_progress), and meanwhile the request reads and writes its slot, so no one needs to
know where it decodes. Its newest tokens wait in its row of `recent` until its token list is
read (which takes them in: Request.token_ids), the row fills (its list then takes all but the
newest block's worth), or it leaves: appending every request's token to its own list at every
step touched each request's list, a cache miss apiece, and was the largest per-token cost of a
step. A block the step completes is read from the row too, packed for its hash in one array
operation for all such requests (apply's FilledBlocks): reading each one's list for it cost more
than the rest of the step.
Its stops are stop_checker's rules for such requests, in vector form: the length limit it is
given (stop_checker.length_limit) and the EOS ids.
"""

from collections.abc import Iterable, Sequence
from dataclasses import dataclass

import numpy as np

from kv_manager.prefix_hash import TOKEN_FORMAT
from protos.limits import UNHELD_DECODE_TOKEN as UNHELD_TOKEN
from scheduler_service.core.request import Request, token_list_of

_GROWTH = 2
# Tokens a slot holds, in blocks. A full row hands its list all but its newest block's worth,
# which the next completed block needs: a wider row does that more rarely.
_RECENT_BLOCKS = 8


@dataclass(slots=True)
class BulkStep:
    """The bulk decodes of one planned step, until its result is in."""

    slots: np.ndarray
    # Each slot's epoch when planned: a slot left (and maybe reused) since then is stale.
    epochs: np.ndarray
    # Computed tokens of each request once the step has run.
    computed: np.ndarray
    handles: list[int]


@dataclass(slots=True)
class BulkResult:
    """What a step's bulk decodes gave."""

    # Requests that got one token and go on, with their tokens and delivery keys, in the same
    # order.
    requests: list[Request]
    token_ids: list[int]
    keys: np.ndarray
    # Requests whose token ends them (EOS or length): the scheduler finishes them.
    stopped: list[tuple[Request, int]]
    # Requests whose computed tokens now complete a block.
    filled: "FilledBlocks"
    # Requests the executor answered for with UNHELD_TOKEN.
    unheld: list[Request]
    # Seconds since the previous token, for each request that got one and had had one before.
    gaps: np.ndarray


@dataclass(slots=True)
class FilledBlocks:
    """Requests whose computed tokens the step brought to a multiple of the block size."""

    # Those whose completed block the slot's row holds, its tokens packed for the prefix hash
    # (prefix_hash.pack_tokens), with their computed-token counts, in the same order.
    requests: list[Request]
    num_computed: list[int]
    packed_blocks: list[bytes]
    # The others (part of the block is in the list already), with their computed-token counts.
    others: list[tuple[Request, int]]


class DecodeSet:
    def __init__(self, block_size: int, eos_token_ids: Iterable[int]) -> None:
        self.block_size = block_size
        self._eos_ids = sorted(eos_token_ids)
        self._requests: list[Request | None] = []
        self._slot_of: dict[Request, int] = {}
        self._free: list[int] = []
        capacity = 64
        self.handle = np.zeros(capacity, dtype=np.int64)
        # Tokens whose K/V the executor has or will have once the steps in flight run.
        self.computed = np.zeros(capacity, dtype=np.int64)
        # Tokens planned to be sampled whose values have not come back yet.
        self.pending = np.zeros(capacity, dtype=np.int64)
        # Tokens the request's blocks can hold.
        self.cover = np.zeros(capacity, dtype=np.int64)
        # Computed tokens at which the request samples its last token: its length limit less one,
        # kept so as to spare the hot comparisons a `computed + 1` each.
        self.last_sample_at = np.zeros(capacity, dtype=np.int64)
        self.stops_on_eos = np.zeros(capacity, dtype=bool)
        self.active = np.zeros(capacity, dtype=bool)
        self.epoch = np.zeros(capacity, dtype=np.int64)
        self.key = np.zeros(capacity, dtype=np.int64)
        # When the last token came back (NaN: none yet).
        self.last_token_at = np.full(capacity, np.nan)
        # Tokens sampled that the request's token list has not taken yet, num_recent of them,
        # laid out as the prefix hash packs them, so that a completed block is hashed as it is.
        self.recent = np.zeros((capacity, _RECENT_BLOCKS * block_size), dtype=TOKEN_FORMAT)
        self._block_columns = np.arange(block_size)
        self.num_recent = np.zeros(capacity, dtype=np.int64)

    def __len__(self) -> int:
        return len(self._slot_of)

    def __contains__(self, request: Request) -> bool:
        return request in self._slot_of

    def join(self, request: Request, handle: int, cover: int, limit: int) -> None:
        if not self._free:
            self._grow()
        slot = self._free.pop()
        self._requests[slot] = request
        self._slot_of[request] = slot
        self.handle[slot] = handle
        self.cover[slot] = cover
        self.last_sample_at[slot] = limit - 1
        self.stops_on_eos[slot] = not request.sampling.ignore_eos
        self.active[slot] = True
        self.key[slot] = request.delivery_key
        request.move_progress(self, slot)

    def leave(self, request: Request) -> None:
        """Hands the request its progress back and frees its slot."""
        slot = self._slot_of.pop(request)
        request.move_progress(None)
        self._requests[slot] = None
        self.active[slot] = False
        self.epoch[slot] += 1
        self._free.append(slot)

    def flush_tokens(self, slot: int, tokens: list[int]) -> None:
        count = int(self.num_recent[slot])
        if count:
            tokens.extend(self.recent[slot, :count].tolist())
            self.num_recent[slot] = 0

    def slot_of(self, request: Request) -> tuple[int, int]:
        """The request's slot and that slot's epoch (what a BulkStep records)."""
        slot = self._slot_of[request]
        return slot, int(self.epoch[slot])

    def pause(self, request: Request, paused: bool = True) -> None:
        """Plans no more tokens for the request (or again, paused False); steps in flight still
        apply."""
        self.active[self._slot_of[request]] = not paused

    def clear(self) -> list[Request]:
        """Everyone leaves; returns who was here."""
        requests = list(self._slot_of)
        for request in requests:
            self.leave(request)
        return requests

    def live(self, step: BulkStep) -> list[Request]:
        """The step's requests still here as they were when it was planned."""
        slots = step.slots[self.epoch[step.slots] == step.epochs]
        return [self._requests[s] for s in slots.tolist()]  # type: ignore[misc]

    def add_cover(self, request: Request, tokens: int) -> None:
        self.cover[self._slot_of[request]] += tokens

    def add_cover_each(self, requests: Sequence[Request], tokens: int) -> None:
        self.cover[[self._slot_of[request] for request in requests]] += tokens

    def needing_blocks(self) -> list[Request]:
        """Requests that will decode but whose next token falls past their blocks."""
        size = len(self._requests)
        active, computed = self.active[:size], self.computed[:size]
        slots = np.flatnonzero(active & (computed >= self.cover[:size]) & (computed < self.last_sample_at[:size]))
        return [self._requests[s] for s in slots.tolist()]  # type: ignore[misc]

    def plan(self, budget: int) -> BulkStep | None:
        """One token for each request that may sample more and has room, up to budget."""
        size = len(self._requests)
        computed = self.computed[:size]
        runnable = self.active[:size] & (computed < self.cover[:size]) & (computed < self.last_sample_at[:size])
        slots = np.flatnonzero(runnable)[:budget]
        if not slots.size:
            return None
        self.computed[slots] += 1
        self.pending[slots] += 1
        return BulkStep(
            slots=slots,
            epochs=self.epoch[slots],
            computed=self.computed[slots],
            handles=self.handle[slots].tolist(),
        )

    def reaching(self, step: BulkStep, interval: int) -> list[tuple[Request, int]]:
        """The step's requests still here whose computed tokens, once it has run, are a
        multiple of interval, with that count (where a hybrid model keeps a checkpoint)."""
        live = self.epoch[step.slots] == step.epochs
        at = np.flatnonzero(live & (step.computed % interval == 0)).tolist()
        return [(self._requests[step.slots[i]], int(step.computed[i])) for i in at]  # type: ignore[misc]

    def apply(self, step: BulkStep, token_ids: Sequence[int], now: float) -> BulkResult:
        """Adds each token to its request (received at now), and says who stops and whose
        blocks filled."""
        tokens = np.asarray(token_ids, dtype=np.int64)
        slots = step.slots
        live = self.epoch[slots] == step.epochs
        unheld_mask = live & (tokens == UNHELD_TOKEN)
        live &= ~unheld_mask
        unheld: list[Request] = [self._requests[s] for s in slots[unheld_mask].tolist()]  # type: ignore[misc]
        result = BulkResult([], [], np.zeros(0, dtype=np.int64), [], FilledBlocks([], [], [], []), unheld, np.zeros(0))
        if not live.any():
            return result
        slots, tokens, computed = slots[live], tokens[live], step.computed[live]
        self.pending[slots] -= 1
        previous = self.last_token_at[slots]
        result.gaps = now - previous[~np.isnan(previous)]
        self.last_token_at[slots] = now
        keys = self.key[slots]
        # The step sampled the token after its computed ones, and results come back in order, so
        # this is each request's token number `computed + 1`.
        stops = computed >= self.last_sample_at[slots]
        on_eos = self.stops_on_eos[slots]
        # A comparison per EOS id: models have one to three, and np.isin's set-up costs more.
        for eos in self._eos_ids:
            stops |= on_eos & (tokens == eos)
        filled = computed % self.block_size == 0
        requests = self._requests
        at = self.num_recent[slots]
        full = at >= self.recent.shape[1]
        if full.any():
            self._make_room(slots[full])
            at[full] = self.block_size
        self.recent[slots, at] = tokens
        at += 1
        self.num_recent[slots] = at
        token_list = tokens.tolist()
        live_requests: list[Request] = [requests[s] for s in slots.tolist()]  # type: ignore[misc]
        if stops.any():
            stop_at = np.flatnonzero(stops).tolist()
            result.stopped = [(live_requests[i], token_list[i]) for i in stop_at]
            go_on = np.flatnonzero(~stops).tolist()
            result.requests = [live_requests[i] for i in go_on]
            result.token_ids = [token_list[i] for i in go_on]
            result.keys = keys[~stops]
        else:
            result.requests, result.token_ids, result.keys = live_requests, token_list, keys
        if filled.any():
            result.filled = self._filled_blocks(np.flatnonzero(filled), slots, at, computed, live_requests)
        return result

    def tokens_of(self, request: Request) -> list[int]:
        """The request's tokens, its slot's included, leaving them in the slot (reading
        Request.token_ids would move them into its list and empty the row that the blocks it
        completes next are read from)."""
        slot = self._slot_of[request]
        return token_list_of(request) + self.recent[slot, : self.num_recent[slot]].tolist()

    def _make_room(self, slots: np.ndarray) -> None:
        """Full rows hand their lists all but their newest block's worth of tokens, which move
        to the rows' start."""
        keep = self.block_size
        cut = self.recent.shape[1] - keep
        for slot in slots.tolist():
            token_list_of(self._requests[slot]).extend(self.recent[slot, :cut].tolist())  # type: ignore[arg-type]
        self.recent[slots, :keep] = self.recent[slots, cut:]

    def _filled_blocks(
        self, indexes: np.ndarray, slots: np.ndarray, counts: np.ndarray, computed: np.ndarray, requests: list[Request]
    ) -> FilledBlocks:
        """The blocks completed at indexes (of the step's live slots, whose rows now hold
        counts tokens and whose requests computed computed): a row ends with the token sampled
        after the block, so it holds the whole block when it holds more than a block's worth."""
        block_size = self.block_size
        filled = FilledBlocks([], [], [], [])
        counts = counts[indexes]
        in_row = counts > block_size
        kept = indexes
        if not in_row.all():
            kept, counts = indexes[in_row], counts[in_row]
            filled.others = [(requests[i], int(computed[i])) for i in indexes[~in_row].tolist()]
        if kept.size:
            columns = (counts - (1 + block_size))[:, None] + self._block_columns
            packed = self.recent[slots[kept][:, None], columns].tobytes()
            width = block_size * self.recent.itemsize
            filled.packed_blocks = [packed[i : i + width] for i in range(0, len(packed), width)]
            filled.requests = [requests[i] for i in kept.tolist()]
            filled.num_computed = computed[kept].tolist()
        return filled

    def _grow(self) -> None:
        old = len(self._requests)
        new = max(64, old * _GROWTH)
        names = ("handle", "computed", "pending", "cover", "last_sample_at", "stops_on_eos", "active", "epoch", "key", "last_token_at", "num_recent", "recent")
        for name in names:
            array = getattr(self, name)
            if array.shape[0] < new:
                grown = np.zeros((new, *array.shape[1:]), dtype=array.dtype)
                grown[: array.shape[0]] = array
                setattr(self, name, grown)
        self._requests.extend([None] * (new - old))
        self._free.extend(range(new - 1, old - 1, -1))
