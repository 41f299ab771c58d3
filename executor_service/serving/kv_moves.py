"""K/V that moves between executors, this executor's part: the offers it serves (StepPlan
kv_exports, ended_exports) and the imports it fetches (kv_imports, cancelled_imports).

Everything here but the fetches runs on the worker thread, the only one that touches the cache,
so offers and imports need no lock: a plan's cancellations, finished imports' writes and offers
are all handled before its forward (the K/V of earlier plans is then written), and offered blocks
are read there between plans. Fetches run on the event loop and hand their bytes back through
their futures.

A model with recurrent layers moves a request's state slot with its blocks: the offer's last
chunk carries it (a chunk of its own, after the blocks, so that the blocks' chunks keep their size
and an offer with no block left to send still sends it), and an import writes it into its slot
when it writes the blocks."""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Callable, Sequence
from concurrent.futures import Future
from dataclasses import dataclass

from executor_service.serving.kv_fetch import FetchedBlocks, FetchFailed, KvFetcher
from executor_service.serving.metrics import ExecutorMetrics
from protos.splitserve.executor.v1 import executor_pb2

logger = logging.getLogger(__name__)

# Blocks per KvBlockChunk: whole blocks up to about this many bytes, far under the message limit.
CHUNK_BYTES = 4 << 20



def logged_id(transfer_id: str) -> str:
    """What logs show of a transfer id: enough to follow a move, too little to fetch its blocks
    (the id is what names them)."""
    return transfer_id[:8]

class OfferClosed(Exception):
    """No offer of that transfer id is open (never made, ended, or dropped with its stream)."""


@dataclass(slots=True, frozen=True)
class StateAccess:
    """How recurrent-state slots are read and written (the runner's read_state and write_state,
    which raises ValueError, writing nothing, for bytes or a slot it cannot take)."""

    read: Callable[[int], bytes]
    write: Callable[[int, bytes], None]
    num_slots: int


@dataclass(slots=True, frozen=True)
class BlockAccess:
    """How the cache is read and written (the runner's read_blocks and write_blocks), and what a
    block holds: ExecutorInfo's kv_layout, and its size in bytes. state: None for a model without
    recurrent layers."""

    read: Callable[[list[int]], bytes]
    write: Callable[[list[int], bytes], None]
    kv_layout: str
    block_bytes: int
    num_blocks: int
    state: StateAccess | None = None


@dataclass(slots=True, frozen=True)
class _Offer:
    block_ids: list[int]
    # 0: no recurrent state goes with the blocks.
    state_slot: int


@dataclass(slots=True)
class _Import:
    entry: executor_pb2.KvImport
    # When the plan that asked for it was taken (monotonic seconds).
    asked_at: float
    fetch: Future[FetchedBlocks]


class KvMoves:
    """fetcher: None where this executor moves no K/V (ExecutorInfo.supports_kv_transfer off):
    imports then fail at once and offers are not made."""

    def __init__(
        self,
        blocks: BlockAccess,
        fetcher: KvFetcher | None,
        loop: asyncio.AbstractEventLoop,
        metrics: ExecutorMetrics,
    ) -> None:
        self._blocks = blocks
        self._fetcher = fetcher
        self._loop = loop
        self._metrics = metrics
        self._offers: dict[str, _Offer] = {}
        self._imports: dict[str, _Import] = {}
        self._chunk_blocks = max(1, CHUNK_BYTES // max(1, blocks.block_bytes))

    def before_plan(self, plan: executor_pb2.StepPlan) -> list[executor_pb2.KvImportResult]:
        """On the worker thread, before the plan's forward: its cancellations, then the writes of
        imports fetched since the last plan, then its offers and new imports. Returns the imports
        that ended, for its StepResult.kv_imports_done."""
        now = time.monotonic()
        for transfer_id in plan.cancelled_imports:
            cancelled = self._imports.pop(transfer_id, None)
            if cancelled is not None:
                cancelled.fetch.cancel()
                logger.info("event=kv_import_cancelled transfer=%s", logged_id(transfer_id))
        done = self._write_fetched()
        for transfer_id in plan.ended_exports:
            if self._offers.pop(transfer_id, None) is not None:
                logger.info("event=kv_offer_ended transfer=%s", logged_id(transfer_id))
        for export in plan.kv_exports:
            self._offer(export)
        for entry in plan.kv_imports:
            problem = self._import_problem(entry)
            if problem is not None:
                done.append(self._ended(executor_pb2.KvImportResult(transfer_id=entry.transfer_id, error=problem)))
                continue
            assert self._fetcher is not None  # _import_problem refuses every import without one
            # A copy: the entry would keep the whole plan's message alive until the fetch ends.
            kept = executor_pb2.KvImport()
            kept.CopyFrom(entry)
            fetch = asyncio.run_coroutine_threadsafe(self._fetcher.fetch(kept), self._loop)
            self._imports[entry.transfer_id] = _Import(kept, now, fetch)
            logger.info(
                "event=kv_import_started transfer=%s source=%s first_block=%d blocks=%d",
                logged_id(entry.transfer_id), entry.source_address, entry.first_block, len(entry.block_ids),
            )
        return done

    def drop_all(self) -> None:
        """On the worker thread, when a new plan stream starts over: every offer closes and every
        import is abandoned, unreported (the scheduler that opens a stream knows of none)."""
        if self._offers or self._imports:
            logger.info("event=kv_moves_dropped offers=%d imports=%d", len(self._offers), len(self._imports))
        self._offers.clear()
        for pending in self._imports.values():
            pending.fetch.cancel()
        self._imports.clear()

    def read_chunk(self, transfer_id: str, position: int) -> executor_pb2.KvBlockChunk | None:
        """On the worker thread: the offer's next chunk from position on (past its last block,
        the chunk of its state, with no blocks, where it has a state slot), None past the end;
        OfferClosed when no such offer is open."""
        offer = self._offers.get(transfer_id)
        if offer is None:
            raise OfferClosed(transfer_id)
        chunk = executor_pb2.KvBlockChunk(first_block=position, kv_layout=self._blocks.kv_layout)
        block_ids = offer.block_ids[position : position + self._chunk_blocks]
        if block_ids:
            chunk.num_blocks, chunk.data = len(block_ids), self._blocks.read(block_ids)
        elif offer.state_slot and position == len(offer.block_ids):
            assert self._blocks.state is not None  # _offer refuses a state slot without state
            chunk.state = self._blocks.state.read(offer.state_slot)
        else:
            return None
        return chunk

    def _offer(self, export: executor_pb2.KvExport) -> None:
        problem = (
            "needs a transfer_id" if not export.transfer_id
            else "unsupported by this executor (ExecutorInfo.supports_kv_transfer)" if self._fetcher is None
            else _blocks_problem(export.block_ids, self._blocks.num_blocks, export.state_slot)
            or _state_slot_problem(export.state_slot, self._blocks.state)
        )
        if problem is not None:
            # Nothing to answer: the destination's fetch finds no offer and fails its import.
            logger.warning("event=kv_offer_refused transfer=%s problem=%r", logged_id(export.transfer_id), problem)
            return
        self._offers[export.transfer_id] = _Offer(list(export.block_ids), export.state_slot)
        logger.info(
            "event=kv_offer_opened transfer=%s blocks=%d state_slot=%d",
            logged_id(export.transfer_id), len(export.block_ids), export.state_slot,
        )

    def _import_problem(self, entry: executor_pb2.KvImport) -> str | None:
        if self._fetcher is None:
            return "this executor does not move K/V (ExecutorInfo.supports_kv_transfer is off)"
        if not entry.transfer_id:
            return "an import needs a transfer_id"
        if entry.transfer_id in self._imports:
            return f"transfer {entry.transfer_id!r} is already being imported"
        if not entry.source_address:
            return "an import needs a source_address"
        return _blocks_problem(entry.block_ids, self._blocks.num_blocks, entry.state_slot) or _state_slot_problem(
            entry.state_slot, self._blocks.state
        )

    def _write_fetched(self) -> list[executor_pb2.KvImportResult]:
        """Writes every import whose fetch has finished, in the order they were asked for."""
        done = []
        for transfer_id in [key for key, pending in self._imports.items() if pending.fetch.done()]:
            pending = self._imports.pop(transfer_id)
            result = self._write(pending)
            result.seconds = time.monotonic() - pending.asked_at
            done.append(self._ended(result))
        return done

    def _write(self, pending: _Import) -> executor_pb2.KvImportResult:
        result = executor_pb2.KvImportResult(transfer_id=pending.entry.transfer_id)
        try:
            fetched = pending.fetch.result()
            # The state first: its checks may fail the import, and then nothing is written.
            self._write_state(pending.entry, fetched)
            for block_ids, data in fetched.chunks:
                self._blocks.write(block_ids, data)
        except FetchFailed as error:
            result.error = str(error)
        except Exception as error:
            # A failure of this executor's own (a fetch or a write that raised): the import
            # fails, the step goes on.
            logger.exception("event=kv_import_error transfer=%s", logged_id(pending.entry.transfer_id))
            result.error = f"{type(error).__name__}: {error}"
        else:
            result.ok, result.bytes = True, fetched.num_bytes
        return result

    def _write_state(self, entry: executor_pb2.KvImport, fetched: FetchedBlocks) -> None:
        """The offer's recurrent state into the import's slot; FetchFailed, writing nothing, when
        the offer had none or the slot cannot take it. Without a slot, state the offer carried
        is not wanted (the scheduler recomputes the request's state)."""
        if not entry.state_slot:
            return
        assert self._blocks.state is not None  # _import_problem refuses a state slot without state
        if not fetched.state:
            raise FetchFailed(f"from {entry.source_address}: the offer carried no recurrent state")
        try:
            self._blocks.state.write(entry.state_slot, fetched.state)
        except ValueError as error:
            raise FetchFailed(f"state_slot {entry.state_slot}: {error}") from None

    def _ended(self, result: executor_pb2.KvImportResult) -> executor_pb2.KvImportResult:
        self._metrics.observe_import(result)
        if result.ok:
            logger.info(
                "event=kv_import_done transfer=%s bytes=%d seconds=%.4f", logged_id(result.transfer_id), result.bytes, result.seconds
            )
        else:
            logger.warning("event=kv_import_failed transfer=%s error=%r", logged_id(result.transfer_id), result.error)
        return result


def _blocks_problem(block_ids: Sequence[int], num_blocks: int, state_slot: int) -> str | None:
    """state_slot: a move of a recurrent state may have no block left to move."""
    if not block_ids and not state_slot:
        return "names no blocks"
    outside = [block for block in block_ids if block >= num_blocks]
    if outside:
        return f"block id {outside[0]} outside the pool [0, {num_blocks})"
    if len(set(block_ids)) != len(block_ids):
        return "block_ids repeats a block"
    return None


def _state_slot_problem(state_slot: int, state: StateAccess | None) -> str | None:
    if not state_slot:
        return None
    if state is None:
        return f"state_slot {state_slot} named, but the model has no recurrent layers"
    if not 1 <= state_slot <= state.num_slots:
        return f"state_slot {state_slot} outside [1, {state.num_slots}]"
    return None
