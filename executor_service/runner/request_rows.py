"""The executor's persistent batch: every held request has a row here, kept across steps and
changed only by what a plan changes.

A row holds the request's tokens, its progress (tokens known, tokens computed, block table), its
sampling settings as flags and numbers, and its penalty counts. A step of steady decodes then
gathers its inputs and its sampling batch from these tables with a handful of array operations
instead of rebuilding them from every request's token and block lists, so the host work of a
step follows what changed, not how long the contexts are (vLLM keeps its InputBatch for the same
reason).

This is the one home of a request's tokens and progress: RequestState reads them from here, and
only RequestRows' methods change them.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field, replace

import numpy as np
import torch

from executor_service.kernels.row_kernels import RowKernels
from executor_service.sampling.penalty_counts import PenaltyCounts
from executor_service.sampling.position_seed import position_seed
from executor_service.sampling.sampler_settings import SamplerSettings
from executor_service.sampling.sampling_batch import (
    Penalties,
    SamplingBatch,
    logit_shaping_of,
    masks_stop_ids,
    penalties_of,
)
from protos.splitserve.executor.v1 import executor_pb2

# Columns of RequestRows.ints, .floats and .flags: one gather per table fetches a step's rows.
COMPUTED, NUM_TOKENS, NUM_PROMPT, NUM_BLOCKS, LAST_TOKEN, PENALTY_ROW, TOP_K, NUM_LOGPROBS, MIN_TOKENS = range(9)
TEMPERATURE, TOP_P, MIN_P, REPETITION, PRESENCE, FREQUENCY = range(6)
GREEDY, PENALISED, WANT_LOGPROBS, HAS_STOP_IDS, SEEDED, SHAPED = range(6)
# The ints columns RowKernels reads and writes, in the order kernels/steady_rows.c names them.
KERNEL_COLUMNS = np.array([COMPUTED, NUM_TOKENS, NUM_BLOCKS, LAST_TOKEN], dtype=np.int64)
KERNEL_COLUMNS.flags.writeable = False


@dataclass(slots=True, eq=False)
class RequestState:
    """A held request: who it is and how it samples; its tokens and progress live in its row."""

    request_id: str
    # Leading tokens that count as prompt for penalties; the rest count as output.
    num_prompt_tokens: int
    sampling: SamplerSettings
    # The request's own generator when seeded, so its draws ignore the rest of the batch.
    generator: torch.Generator | None
    # Its name in StepPlan.decode_handles (0: none).
    handle: int
    row: int
    rows: RequestRows
    # Where its recurrent layers keep their state (NewRequest.state_slot); 0: none.
    state_slot: int = 0
    # Records of the prompt tokens scored so far (want_prompt_logprobs), until the step that
    # samples after the prompt reports them.
    prompt_logprobs: list[executor_pb2.TokenLogprob] = field(default_factory=list)
    # Leading tokens whose K/V the draft model (draft_model.py) holds in its own cache; a request
    # rebuilt here starts again from none.
    num_draft_computed: int = 0

    @property
    def num_tokens(self) -> int:
        """Every known token: prompt, tokens generated before any preemption, tokens sampled here."""
        return int(self.rows.ints[self.row, NUM_TOKENS])

    @property
    def num_computed_tokens(self) -> int:
        """Leading tokens whose K/V this executor has written (or the plan said were cached)."""
        return int(self.rows.ints[self.row, COMPUTED])

    @property
    def block_ids(self) -> list[int]:
        """The block table from the plans: token i's K/V live in block_ids[i // block_size]."""
        return self.rows.blocks[self.row, : self.rows.ints[self.row, NUM_BLOCKS]].tolist()

    def tokens(self, start: int, end: int) -> list[int]:
        """Known tokens [start, end)."""
        return self.rows.tokens[self.row, start : min(end, self.num_tokens)].tolist()

    @property
    def prompt_token_ids(self) -> list[int]:
        return self.tokens(0, self.num_prompt_tokens)

    @property
    def output_token_ids(self) -> list[int]:
        return self.tokens(self.num_prompt_tokens, self.num_tokens)

    @property
    def num_output_tokens(self) -> int:
        return self.num_tokens - self.num_prompt_tokens

    def seeded_generator(self, drafts_before: int = 0) -> torch.Generator | None:
        """The generator, re-seeded for the position of the token about to be sampled, or of the
        one after that many drafts (ContinuingRequest.draft_token_ids). A draft's row gets a
        generator of its own: the request's rows of one step draw side by side."""
        if self.generator is None or self.sampling.seed is None:
            return None
        generator = torch.Generator(device=self.generator.device) if drafts_before else self.generator
        return generator.manual_seed(position_seed(self.sampling.seed, self.num_tokens + drafts_before))


class RequestRows:
    """Rows are reused after release; the tables grow by doubling. The tables are public for
    the step builders to gather from and are written only here.

    kernels: a steady step's gather (SteadyDecodes) and write-back (decoded) in one C call each;
    numpy's operations where None."""

    def __init__(self, vocab_size: int, device: torch.device, kernels: RowKernels | None = None) -> None:
        self.device = device
        self.kernels = kernels
        self.penalty_counts = PenaltyCounts(vocab_size, device)
        self.states: list[RequestState | None] = []
        self._free: list[int] = []
        self.ints = np.zeros((0, 9), dtype=np.int64)
        self.floats = np.zeros((0, 6), dtype=np.float32)
        self.flags = np.zeros((0, 6), dtype=bool)
        # Row r's tokens are tokens[r, :ints[r, NUM_TOKENS]], its block table
        # blocks[r, :ints[r, NUM_BLOCKS]].
        self.tokens = np.zeros((0, 0), dtype=np.int32)
        self.blocks = np.zeros((0, 0), dtype=np.int64)
        # Bumped whenever a request comes or goes, so what was gathered for a set of rows
        # (SteadyDecodes, _StaticSampling) is known to still describe the same requests.
        self.version = 0
        self._static: _StaticSampling | None = None

    def admit(
        self,
        request_id: str,
        token_ids: Sequence[int],
        num_prompt_tokens: int,
        block_ids: Sequence[int],
        num_computed_tokens: int,
        sampling: SamplerSettings,
        generator: torch.Generator | None = None,
        handle: int = 0,
        state_slot: int = 0,
    ) -> RequestState:
        """A row for a request that starts with these tokens and blocks."""
        if not self._free:
            self._grow_rows()
        row = self._free.pop()
        self.version += 1
        state = RequestState(
            request_id=request_id,
            num_prompt_tokens=num_prompt_tokens,
            sampling=sampling,
            generator=generator,
            handle=handle,
            row=row,
            rows=self,
            state_slot=state_slot,
        )
        self.states[row] = state
        self.ints[row] = 0
        self.ints[row, COMPUTED] = num_computed_tokens
        self.ints[row, NUM_PROMPT] = num_prompt_tokens
        if len(token_ids) > self.tokens.shape[1]:
            self.tokens = _widened(self.tokens, len(token_ids))
        self.tokens[row, : len(token_ids)] = token_ids
        self.ints[row, NUM_TOKENS] = len(token_ids)
        self.ints[row, LAST_TOKEN] = token_ids[-1] if token_ids else 0
        self.add_blocks(state, block_ids)
        self._set_sampling(row, sampling, token_ids, num_prompt_tokens)
        return state

    def release(self, state: RequestState) -> None:
        row = state.row
        if self.states[row] is not state:
            return
        if self.flags[row, PENALISED]:
            self.penalty_counts.release(int(self.ints[row, PENALTY_ROW]))
        self.states[row] = None
        # Table entries past a row's blocks stay block 0, the padding every reader expects.
        self.blocks[row, : self.ints[row, NUM_BLOCKS]] = 0
        self._free.append(row)
        self.version += 1

    def clear(self) -> None:
        self.penalty_counts.clear()
        self.blocks[:] = 0
        self.states = [None] * len(self.states)
        self._free = list(range(len(self.states) - 1, -1, -1))
        self.version += 1

    def add_blocks(self, state: RequestState, block_ids: Sequence[int]) -> None:
        row = state.row
        start = int(self.ints[row, NUM_BLOCKS])
        end = start + len(block_ids)
        if end > self.blocks.shape[1]:
            self.blocks = _widened(self.blocks, end)
        self.blocks[row, start:end] = block_ids
        self.ints[row, NUM_BLOCKS] = end

    def keep_blocks(self, state: RequestState, num_blocks: int) -> None:
        """The request's block table ends after its first num_blocks blocks (if longer)."""
        row = state.row
        self.ints[row, NUM_BLOCKS] = min(int(self.ints[row, NUM_BLOCKS]), num_blocks)

    def advance(self, state: RequestState, num_tokens: int) -> None:
        """num_tokens more of the request's tokens are computed."""
        self.ints[state.row, COMPUTED] += num_tokens

    def append_tokens(self, rows: np.ndarray, token_ids: Sequence[int]) -> None:
        """Each row's request has one more token (output: it counts for penalties); rows are
        distinct. The rows' static sampling inputs, kept by sampling() for this step, say which
        rows count penalties."""
        if len(rows):
            self._append(rows, self.ints[rows], token_ids)

    def extend_tokens(self, state: RequestState, token_ids: Sequence[int]) -> None:
        """The request has these tokens more (output), as many decodes would have appended
        them, each counted for its penalties: a verify step's answer, the accepted drafts and
        the token after them (ContinuingRequest.draft_token_ids)."""
        row = state.row
        start = int(self.ints[row, NUM_TOKENS])
        end = start + len(token_ids)
        if end > self.tokens.shape[1]:
            self.tokens = _widened(self.tokens, end)
        self.tokens[row, start:end] = token_ids
        self.ints[row, NUM_TOKENS] = end
        self.ints[row, LAST_TOKEN] = token_ids[-1]
        if self.flags[row, PENALISED]:
            counts_row = int(self.ints[row, PENALTY_ROW])
            self.penalty_counts.record(
                torch.full((len(token_ids),), counts_row, dtype=torch.long, device=self.device),
                torch.tensor(list(token_ids), dtype=torch.long, device=self.device),
            )

    def decoded(self, rows: np.ndarray, token_ids: Sequence[int]) -> None:
        """A steady step ran: each row's last token is computed and its next one sampled; rows
        are distinct."""
        if self.kernels is None:
            ints = self.ints[rows]
            ints[:, COMPUTED] = ints[:, NUM_TOKENS]
            self._append(rows, ints, token_ids)
            return
        static = self._static_sampling(rows)
        host_counts = self.penalty_counts.host_output
        counts = None
        if static.batch.penalties is not None and host_counts is not None:
            counts = (host_counts, static.penalised, static.counts_rows)
        needed = self.kernels.decoded(self.ints, KERNEL_COLUMNS, self.tokens, rows, token_ids, counts)
        if needed > 0:
            self.tokens = _widened(self.tokens, needed)
            needed = self.kernels.decoded(self.ints, KERNEL_COLUMNS, self.tokens, rows, token_ids, counts)
        if needed < 0:
            raise ValueError(f"a sampled token lies outside the vocabulary of {host_counts.shape[1]}")  # type: ignore[union-attr]
        if counts is None:
            self._record_penalties(static, np.array(token_ids, dtype=np.int64))

    def _append(self, rows: np.ndarray, ints: np.ndarray, token_ids: Sequence[int]) -> None:
        """append_tokens on the rows' gathered ints, which it writes back."""
        tokens = np.array(token_ids, dtype=np.int64)
        ends = ints[:, NUM_TOKENS]
        if ends.max() >= self.tokens.shape[1]:
            self.tokens = _widened(self.tokens, int(ends.max()) + 1)
        self.tokens[rows, ends] = tokens
        ints[:, NUM_TOKENS] += 1
        ints[:, LAST_TOKEN] = tokens
        self.ints[rows] = ints
        self._record_penalties(self._static_sampling(rows), tokens)

    def _record_penalties(self, static: _StaticSampling, tokens: np.ndarray) -> None:
        penalties = static.batch.penalties
        if penalties is not None:
            self.penalty_counts.record(penalties.counts_rows, torch.from_numpy(tokens).to(self.device)[penalties.index])

    def sampling(self, rows: np.ndarray, drafts: Sequence[Sequence[int]] | None = None) -> SamplingBatch:
        """The sampling batch of these rows, in their order, for each row's next token.
        drafts: per row, the drafts (ContinuingRequest.draft_token_ids) between the request's
        known tokens and the token it samples, which it samples as a decode would after them
        (its seed's position, its count of outputs, its penalties' counts); a request with
        drafts names its row once per position. None: no drafts."""
        static = self._static_sampling(rows)
        batch = static.batch
        drafts_before = None if drafts is None else np.array([len(ahead) for ahead in drafts], dtype=np.int64)
        if static.seeded.size:
            generators = list(batch.generators)
            for i in static.seeded.tolist():
                ahead = 0 if drafts_before is None else int(drafts_before[i])
                generators[i] = self.states[rows[i]].seeded_generator(ahead)  # type: ignore[union-attr]
            batch = replace(batch, generators=generators)
        if static.stop_rows.size:
            stop_rows = rows[static.stop_rows]
            ints = self.ints[stop_rows]
            if drafts_before is not None:
                # A copy (fancy indexing): the drafts before a row count as its outputs.
                ints[:, NUM_TOKENS] += drafts_before[static.stop_rows]
            masked = static.stop_rows[_masks_stop_ids(ints, self.flags[stop_rows])]
            batch = replace(
                batch,
                stop_masks=[
                    (i, self.states[rows[i]].sampling.min_tokens_stop_ids)  # type: ignore[union-attr]
                    for i in masked.tolist()
                ],
            )
        if drafts is not None and batch.penalties is not None:
            batch = replace(batch, penalties=_counting_drafts(batch.penalties, static.penalised, drafts))
        return batch

    def argmax_only(self, rows: np.ndarray) -> list[bool]:
        """Per row, whether its next token is the logits' argmax and nothing else is read from
        them (no penalties, logprobs, stop masks, allowed tokens or biases)."""
        static = self._static_sampling(rows)
        if not static.stop_rows.size:
            return static.argmax_only
        ints, flags = self.ints[rows], self.flags[rows]
        return (static.argmax_only_unmasked & ~_masks_stop_ids(ints, flags)).tolist()

    def _static_sampling(self, rows: np.ndarray) -> _StaticSampling:
        """What of these rows' sampling stays the same from step to step, kept for the last set
        of rows (a steady decode names the same rows step after step)."""
        static = self._static
        if static is not None and static.version == self.version:
            if static.rows is rows:
                return static
            if np.array_equal(static.rows, rows):
                # Later steps name the new object: an identity check costs less than comparing.
                static.rows = rows
                return static
        ints, floats, flags = self.ints[rows], self.floats[rows], self.flags[rows]
        greedy = flags[:, GREEDY]
        penalised = np.flatnonzero(flags[:, PENALISED])
        counts_rows = ints[penalised, PENALTY_ROW]
        penalties = None
        if len(penalised):
            chosen = floats[penalised]
            penalties = penalties_of(
                penalised,
                chosen[:, REPETITION],
                chosen[:, PRESENCE],
                chosen[:, FREQUENCY],
                self.penalty_counts,
                counts_rows,
            )
        unmasked = greedy & ~flags[:, PENALISED] & ~flags[:, WANT_LOGPROBS] & ~flags[:, SHAPED]
        shaped = np.flatnonzero(flags[:, SHAPED]).tolist()
        self._static = _StaticSampling(
            rows=rows,
            version=self.version,
            batch=SamplingBatch(
                greedy=greedy,
                temperature=floats[:, TEMPERATURE],
                top_k=ints[:, TOP_K],
                top_p=floats[:, TOP_P],
                min_p=floats[:, MIN_P],
                want_logprobs=flags[:, WANT_LOGPROBS],
                num_logprobs=ints[:, NUM_LOGPROBS],
                generators=[None] * len(rows),
                stop_masks=[],
                penalties=penalties,
                shaping=logit_shaping_of(
                    shaped,
                    [self.states[rows[i]].sampling for i in shaped],  # type: ignore[union-attr]
                    self.penalty_counts.vocab_size,
                    self.device,
                ),
            ),
            penalised=penalised,
            counts_rows=counts_rows,
            seeded=np.flatnonzero(flags[:, SEEDED] & ~greedy),
            stop_rows=np.flatnonzero(flags[:, HAS_STOP_IDS]),
            argmax_only_unmasked=unmasked,
            argmax_only=unmasked.tolist(),
        )
        return self._static

    def _set_sampling(
        self, row: int, sampling: SamplerSettings, token_ids: Sequence[int], num_prompt_tokens: int
    ) -> None:
        self.ints[row, TOP_K] = sampling.top_k
        self.ints[row, NUM_LOGPROBS] = sampling.num_logprobs
        self.ints[row, MIN_TOKENS] = sampling.min_tokens
        self.floats[row] = (
            sampling.temperature,
            sampling.top_p,
            sampling.min_p,
            sampling.repetition_penalty,
            sampling.presence_penalty,
            sampling.frequency_penalty,
        )
        self.flags[row] = (
            sampling.greedy,
            sampling.has_penalties,
            sampling.want_logprobs,
            bool(sampling.min_tokens_stop_ids),
            sampling.seed is not None,
            sampling.shapes_logits,
        )
        if sampling.has_penalties:
            self.ints[row, PENALTY_ROW] = self.penalty_counts.add(
                token_ids[:num_prompt_tokens], token_ids[num_prompt_tokens:]
            )

    def _grow_rows(self) -> None:
        old = len(self.states)
        new = max(16, old * 2)
        self.ints = _lengthened(self.ints, new)
        self.floats = _lengthened(self.floats, new)
        self.flags = _lengthened(self.flags, new)
        self.tokens = _lengthened(self.tokens, new)
        self.blocks = _lengthened(self.blocks, new)
        self.states.extend([None] * (new - old))
        self._free.extend(range(new - 1, old - 1, -1))


@dataclass(slots=True)
class _StaticSampling:
    """A set of rows' sampling inputs that do not change while the same requests hold them."""

    rows: np.ndarray
    version: int
    # The batch without per-step parts: generators all None, no stop masks.
    batch: SamplingBatch
    # Positions in rows of the penalised rows, and their rows in the penalty counts.
    penalised: np.ndarray
    counts_rows: np.ndarray
    # Positions in rows of the seeded draws and of the rows with min-tokens stop ids, whose
    # generators and masks follow the token count.
    seeded: np.ndarray
    stop_rows: np.ndarray
    argmax_only_unmasked: np.ndarray
    argmax_only: list[bool]


def _lengthened(table: np.ndarray, rows: int) -> np.ndarray:
    grown = np.zeros((rows, table.shape[1]), dtype=table.dtype)
    grown[: table.shape[0]] = table
    return grown


def _widened(table: np.ndarray, width: int) -> np.ndarray:
    grown = np.zeros((table.shape[0], max(width, 2 * table.shape[1])), dtype=table.dtype)
    grown[:, : table.shape[1]] = table
    return grown


def _counting_drafts(penalties: Penalties, penalised: np.ndarray, drafts: Sequence[Sequence[int]]) -> Penalties:
    """The penalties with each penalised row's drafts counted as outputs ahead of its counts.
    penalised: the penalised rows' places among the rows drafts describes."""
    places = [i for i, row in enumerate(penalised.tolist()) for _ in drafts[row]]
    if not places:
        return penalties
    tokens = [token for row in penalised.tolist() for token in drafts[row]]
    device = penalties.counts.device
    return replace(
        penalties,
        ahead=(torch.tensor(places, dtype=torch.long, device=device), torch.tensor(tokens, dtype=torch.long, device=device)),
    )


def _masks_stop_ids(ints: np.ndarray, flags: np.ndarray) -> np.ndarray:
    """masks_stop_ids of gathered rows."""
    return masks_stop_ids(flags[:, HAS_STOP_IDS], ints[:, NUM_TOKENS] - ints[:, NUM_PROMPT], ints[:, MIN_TOKENS])
