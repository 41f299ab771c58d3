"""Decode steps replayed from CUDA graphs, one graph per (batch, context width) bucket.

A decode step of a small model is a few hundred kernel launches (SmolLM2: 30 layers of about 15
operations) of a few microseconds of arithmetic each, so on a GPU the launches bound it; a CUDA
graph replays them all as one. A graph fixes every shape and address, so a graphed step runs on
static buffers: the batch padded up to its bucket (padded rows write their K/V to the cache's
scratch slot and attend over one position), each block table padded to the bucket's width
(positions past a sequence's context are masked out). Attention is the sdpa backend's decode
gather (DecodeAttention), its gather index and mask computed inside the graph from the static
table and lengths. A step's inputs reach the device in one copy, into a staging buffer that the
graph reads.

At start-up every bucket is captured, the largest first (capture_all), so serving never stalls on
a capture and smaller graphs reuse the memory the largest left in the shared pool. A capture that
fails switches graphs off (logged once with the reason) and every step runs the eager path. On the
CPU nothing is captured (EagerRecorder): the static path runs as it is, which keeps it tested
without a GPU.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from typing import Protocol

import numpy as np
import torch

from executor_service.attention.attention_metadata import (
    DecodeAttention,
    StepAttention,
    decode_gather_index,
    padded_blocks,
)
from executor_service.attention.kv_cache import PagedKVCache
from executor_service.model.model_loader import LoadedModel
from executor_service.runner.forward import accepts_logits_to_keep, compute_logits
from executor_service.runner.plan_inputs import ScheduledWork, StepInputs
from executor_service.runner.request_rows import RequestRows
from executor_service.runner.steady_decodes import SteadyStep

logger = logging.getLogger(__name__)

Replay = Callable[[], None]


class GraphRecorder(Protocol):
    def capture(self, run: Replay) -> Replay:
        """Returns what replays `run`'s work on the buffers it used."""
        ...


class EagerRecorder:
    """Captures nothing: each replay runs the forward again (CPU, and tests)."""

    def capture(self, run: Replay) -> Replay:
        return run


class CudaGraphRecorder:
    """Captures into CUDA graphs that share one memory pool and one capture stream. Sharing is
    safe because steps run one at a time and a graph's outputs live in buffers allocated outside
    the pool, so nothing one graph leaves in the pool is read after another graph runs."""

    def __init__(self, device: torch.device) -> None:
        self._device = device
        with torch.cuda.device(device):
            self._pool = torch.cuda.graph_pool_handle()
            self._stream = torch.cuda.Stream(device)

    def capture(self, run: Replay) -> Replay:
        # The device context: kernels go to the device's current stream, which must be the
        # capture stream, also on cuda:N with N > 0.
        with torch.cuda.device(self._device):
            current = torch.cuda.current_stream(self._device)
            self._stream.wait_stream(current)
            try:
                with torch.cuda.stream(self._stream):
                    # CUDA wants a warm-up before capture: lazy library and workspace set-up
                    # must not land in the graph.
                    run()
                    torch.cuda.synchronize(self._device)
                    graph = torch.cuda.CUDAGraph()
                    graph.capture_begin(pool=self._pool)
                    try:
                        run()
                    finally:
                        self._end_capture(graph)
            finally:
                current.wait_stream(self._stream)
        return graph.replay

    def _end_capture(self, graph: torch.cuda.CUDAGraph) -> None:
        """Ends the capture; after a failed one also stops routing this thread's allocations
        into the pool, which torch's capture_end skips when the capture was invalidated (later
        eager steps would allocate into the pool and lose the allocator's out-of-memory retry)."""
        try:
            graph.capture_end()
        except Exception:
            end_allocate = getattr(torch._C, "_cuda_endAllocateToPool", None)
            if end_allocate is not None:
                end_allocate(self._device.index or 0, self._pool)
            raise


def decode_graphs_on(device: torch.device, max_batch: int, tensor_parallel_size: int) -> bool:
    """Graphs serve one CUDA device: a rank's collectives would need capturing too."""
    return device.type == "cuda" and max_batch > 0 and tensor_parallel_size == 1


def batch_buckets(max_batch: int) -> tuple[int, ...]:
    """1, 2, 4, 8, 16, 24, 32, then every multiple of 32 up to max_batch: few enough graphs to
    capture all at start-up (14 for 256), and past 32 rows padding is nearly free, a decode
    step being bound by reading the weights."""
    small = [size for size in (1, 2, 4, 8, 16, 24) if size < max_batch]
    return tuple(small + list(range(32, max_batch, 32)) + [max_batch])


def width_buckets(max_width: int) -> tuple[int, ...]:
    """Powers of two of blocks up to max_width, then max_width: a sequence's attention gathers
    at most twice its context."""
    widths = [1 << power for power in range(max_width.bit_length()) if 1 << power < max_width]
    return tuple(widths + [max_width])


def _smallest_at_least(value: int, sizes: tuple[int, ...]) -> int | None:
    return next((size for size in sizes if size >= value), None)


class DecodeGraphs:
    """Logits of pure decode steps through one captured graph per (batch, width) bucket.

    max_batch: the largest batch graphed; max_model_len bounds the table width. A bucket's
    gather must fit the cache's block count (B x W <= num_blocks), the one gather the KV budget
    reserves for graphs; steps outside every bucket run the eager path.
    """

    @torch.inference_mode()
    def __init__(
        self,
        loaded: LoadedModel,
        kv_cache: PagedKVCache,
        max_batch: int,
        max_model_len: int,
        recorder: GraphRecorder,
    ) -> None:
        if loaded.lean is not None:
            raise ValueError("decode graphs run the transformers forward, not the lean CPU one")
        if max_batch < 1:
            raise ValueError(f"max_batch must be at least 1, got {max_batch}")
        self._loaded = loaded
        self._kv_cache = kv_cache
        self._recorder = recorder
        self._use_logits_to_keep = accepts_logits_to_keep(loaded)
        self.batch_sizes = batch_buckets(max_batch)
        self.widths = width_buckets(-(-max_model_len // kv_cache.block_size))
        self._replays: dict[tuple[int, int], Replay] = {}
        self.enabled = True
        # Steps whose logits came from a graph.
        self.graphed_steps = 0
        device = loaded.device
        rows, width = self.batch_sizes[-1], self.widths[-1]
        # A bucket (B, W) reads token ids, positions, slots and context lengths (B each), then
        # its block table (B x W), from the front of this buffer: one copy per step.
        self._staging = torch.zeros(rows * (4 + width), dtype=torch.long, device=device)
        self._row_index = torch.arange(rows, device=device)
        self._logits = torch.empty(rows, loaded.vocab_size, dtype=torch.float32, device=device)

    @property
    def captured(self) -> list[tuple[int, int]]:
        """The (batch, width) buckets that have a graph."""
        return sorted(self._replays)

    def buckets(self) -> list[tuple[int, int]]:
        """Every (batch, width) bucket whose gather fits the cache, the largest first."""
        fitting = [
            (batch, width)
            for batch in self.batch_sizes
            for width in self.widths
            if batch * width <= self._kv_cache.num_blocks
        ]
        return sorted(fitting, key=lambda bucket: (bucket[0] * bucket[1], bucket), reverse=True)

    def bucket(self, work: list[ScheduledWork]) -> tuple[int, int] | None:
        """The (batch, width) bucket of a step, or None when the step is not a pure decode of
        sampled rows, or no bucket holds it."""
        if not self.enabled or not work or any(item.num_tokens != 1 or not item.samples for item in work):
            return None
        block_size = self._kv_cache.block_size
        needed = max(-(-(item.state.num_computed_tokens + 1) // block_size) for item in work)
        batch = _smallest_at_least(len(work), self.batch_sizes)
        width = _smallest_at_least(needed, self.widths)
        if batch is None or width is None or batch * width > self._kv_cache.num_blocks:
            return None
        return batch, width

    @torch.inference_mode()
    def capture_all(self) -> int:
        """Captures every bucket, on all-padding inputs (they write only the scratch slot);
        returns how many graphs there are, 0 when a capture failed and graphs are off."""
        started = time.perf_counter()
        for bucket in self.buckets():
            if bucket not in self._replays:
                self._fill([], bucket)
                if self._capture(bucket) is None:
                    return 0
        logger.info(
            "event=decode_graphs_captured graphs=%d seconds=%.2f", len(self._replays), time.perf_counter() - started
        )
        return len(self._replays)

    @torch.inference_mode()
    def steady_logits(self, rows: RequestRows, step: SteadyStep) -> torch.Tensor | None:
        """logits() for an admitted step of steady decodes, its inputs gathered from the rows'
        tables instead of from each request (SteadyDecodes has checked every row's room)."""
        if not self.enabled:
            return None
        block_size = self._kv_cache.block_size
        positions = step.positions[0]
        needed = positions // block_size + 1
        batch = _smallest_at_least(len(step.rows), self.batch_sizes)
        width = _smallest_at_least(int(needed.max()), self.widths)
        if batch is None or width is None or batch * width > self._kv_cache.num_blocks:
            return None
        held = step.table[:, : min(width, step.table.shape[1])]
        table = np.zeros((len(step.rows), width), dtype=np.int64)
        # Blocks past a row's context are padding, block 0 as padded_blocks gives it.
        table[:, : held.shape[1]] = np.where(np.arange(held.shape[1])[None, :] < needed[:, None], held, 0)
        self._stage((batch, width), step.last_tokens[0], positions, table)
        return self._replay((batch, width), len(step.rows))

    @torch.inference_mode()
    def logits(self, work: list[ScheduledWork]) -> torch.Tensor | None:
        """[len(work), vocab] float32 logits of the step, valid until the next call; None when
        the step is not graphed (the caller runs the eager path)."""
        bucket = self.bucket(work)
        if bucket is None or not self._fill(work, bucket):
            return None
        return self._replay(bucket, len(work))

    def _replay(self, bucket: tuple[int, int], rows: int) -> torch.Tensor | None:
        """The staged step's logits through its bucket's graph (captured now if it has none)."""
        replay = self._replays.get(bucket)
        if replay is None:
            replay = self._capture(bucket)
            if replay is None:
                return None
        replay()
        self.graphed_steps += 1
        return self._logits[:rows]

    def _fill(self, work: list[ScheduledWork], bucket: tuple[int, int]) -> bool:
        """Copies the step into the staging buffer, padding rows up to the bucket; False when a
        request holds fewer blocks than its context needs (the eager path reports that)."""
        block_size = self._kv_cache.block_size
        tokens, positions, table = [], [], []
        for item in work:
            state = item.state
            position = state.num_computed_tokens
            blocks = state.block_ids[: -(-(position + 1) // block_size)]
            if len(blocks) * block_size <= position:
                return False
            tokens.append(state.tokens(position, position + 1)[0])
            positions.append(position)
            table.append(padded_blocks(blocks, bucket[1]))
        tables = np.array(table, dtype=np.int64).reshape(len(work), bucket[1])
        self._stage(bucket, np.array(tokens, dtype=np.int64), np.array(positions, dtype=np.int64), tables)
        return True

    def _stage(self, bucket: tuple[int, int], tokens: np.ndarray, positions: np.ndarray, table: np.ndarray) -> None:
        """Copies a step's rows (each row's block table padded to the bucket's width with block
        0) into the staging buffer, padding rows up to the bucket: they write the scratch slot
        and attend over one position."""
        batch, width = bucket
        block_size = self._kv_cache.block_size
        padding = batch - len(tokens)
        slots = table[np.arange(len(tokens)), positions // block_size] * block_size + positions % block_size
        staged = np.concatenate(
            [
                tokens, np.zeros(padding, dtype=np.int64),
                positions, np.zeros(padding, dtype=np.int64),
                slots, np.full(padding, self._kv_cache.scratch_slot, dtype=np.int64),
                positions + 1, np.ones(padding, dtype=np.int64),
                table.ravel(), np.zeros(width * padding, dtype=np.int64),
            ]
        )
        self._staging[: staged.size].copy_(torch.from_numpy(staged))

    def _capture(self, bucket: tuple[int, int]) -> Replay | None:
        started = time.perf_counter()
        try:
            replay = self._recorder.capture(self._forward(*bucket))
        except Exception as error:
            self.enabled = False
            logger.exception(
                "event=decode_graphs_off batch=%d width=%d reason=%r", bucket[0], bucket[1], str(error)
            )
            return None
        self._replays[bucket] = replay
        logger.debug(
            "event=decode_graph_captured batch=%d width=%d seconds=%.3f",
            bucket[0],
            bucket[1],
            time.perf_counter() - started,
        )
        return replay

    def _forward(self, batch: int, width: int) -> Replay:
        kv_cache = self._kv_cache
        block_size = kv_cache.block_size
        num_kv_heads = kv_cache.shape.num_kv_heads
        staging = self._staging
        tokens, positions, slots, lens = (staging[i * batch : (i + 1) * batch] for i in range(4))
        table = staging[4 * batch : (4 + width) * batch].view(batch, width)

        def run() -> None:
            decodes = DecodeAttention(
                token_index=self._row_index[:batch],
                gather_index=decode_gather_index(table, width * block_size, block_size, num_kv_heads),
                context_lens=lens,
                max_context=width * block_size,
                shared_scratch=False,
            )
            attention = StepAttention(
                kv_cache=kv_cache,
                backend="sdpa",
                slot_mapping=slots,
                prefills=[],
                decodes=[decodes],
                varlen=None,
            )
            inputs = StepInputs(
                input_ids=tokens.view(1, batch),
                position_ids=positions.view(1, batch),
                attention=attention,
                logits_indices=self._row_index[:batch],
                sampled=[],
                sampled_rows=np.zeros(0, dtype=np.int64),
                argmax_only=[],
            )
            self._logits[:batch].copy_(compute_logits(self._loaded, inputs, self._use_logits_to_keep))

        return run
