"""Runs one step plan: applies its diffs to the request states, one forward, sampling, result.

Called from a single worker thread, so plans run strictly in order and never concurrently.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from dataclasses import dataclass, replace

import numpy as np
import torch

from executor_service.attention.host_tier import HostBlocks
from executor_service.attention.kv_cache import PagedKVCache
from executor_service.kernels.row_kernels import RowKernels
from executor_service.model.model_loader import LoadedModel
from executor_service.recurrent.state_slots import StateSlots
from executor_service.recurrent.state_transfer import read_slot, write_slot
from executor_service.runner.block_swaps import run_swaps
from executor_service.runner.decode_graphs import DecodeGraphs
from executor_service.runner.draft_model import DraftModel, DraftRequest
from executor_service.runner.draft_verification import (
    accepted_drafts,
    drafts_before_rows,
)
from executor_service.runner.forward import accepts_logits_to_keep, compute_logits
from executor_service.runner.late_bitmasks import LateBitmasks
from executor_service.runner.plan_inputs import (
    PromptSpan,
    ScheduledWork,
    build_decode_inputs,
    build_step_inputs,
)
from executor_service.runner.request_rows import RequestRows, RequestState
from executor_service.runner.steady_decodes import SteadyDecodes, SteadyStep
from executor_service.runner.validation import (
    Limits,
    bitmask_problem,
    check_continuing,
    check_decode,
    check_decode_block,
    check_new,
    checkpoint_problem,
    copies_problem,
)
from executor_service.sampling.position_seed import make_generator
from executor_service.sampling.sampler import (
    Argmax,
    SampleResult,
    TopLogprobs,
    sample_batch,
    top_logprobs,
)
from executor_service.sampling.sampler_settings import SamplerSettings
from executor_service.sampling.sampling_batch import TokenMasks, token_masks_of
from protos import rpc_codes
from protos.limits import UNHELD_DECODE_TOKEN
from protos.splitserve.executor.v1 import executor_pb2

logger = logging.getLogger(__name__)


@dataclass(slots=True)
class _Admitted:
    """The plan after validation: work to run in plan order (entries, then steady decodes),
    and refused entries."""

    work: list[ScheduledWork]
    rejected: list[executor_pb2.RejectedRequest]
    # Per StepPlan.decode_handles entry, the request it decodes, or None when not held.
    decodes: list[RequestState | None]
    # How many of `work` come from entries; the rest are steady decodes.
    num_entries: int = 0
    # Instead of `work`, for a plan of steady decodes only that all passed their checks: their
    # requests and rows in plan order, for inputs gathered from the rows' arrays.
    steady: SteadyStep | None = None

    def states(self) -> list[RequestState]:
        """The requests that run, in plan order."""
        return self.steady.states if self.steady is not None else [item.state for item in self.work]

    def num_tokens(self) -> int:
        """Tokens computed in the step."""
        return len(self.steady.states) if self.steady is not None else sum(w.num_tokens for w in self.work)

    def prompt_tokens(self) -> int:
        """How many of the step's tokens are prompt (positions below their request's
        num_prompt_tokens); read before the step moves the requests' progress on."""
        if self.steady is not None:
            return 0
        total = 0
        for item in self.work:
            start = item.state.num_computed_tokens
            total += min(item.num_tokens, max(0, item.state.num_prompt_tokens - start))
        return total


class ModelRunner:
    """agree_on_tokens: under tensor parallelism, gives every rank rank 0's sampled tokens, so
    the ranks' request states (the next step's inputs) never drift apart. argmax: what the
    sampler's greedy rows take, torch's when None. graphs: pure decode steps through captured
    CUDA graphs where a bucket holds them. row_kernels: a steady step's bookkeeping in C
    (RequestRows), numpy's where None. host: the host tier of K/V blocks (--kv-host-gib), if any.
    draft: the draft model that proposes ContinuingRequest.num_model_drafts (--draft-model), if
    any."""

    def __init__(
        self,
        loaded: LoadedModel,
        kv_cache: PagedKVCache,
        limits: Limits,
        backend: str,
        agree_on_tokens: Callable[[list[int]], list[int]] | None = None,
        argmax: Argmax | None = None,
        graphs: DecodeGraphs | None = None,
        row_kernels: RowKernels | None = None,
        host: HostBlocks | None = None,
        draft: DraftModel | None = None,
    ) -> None:
        self.loaded = loaded
        self.draft = draft
        self.host = host
        self.graphs = graphs
        self._agree_on_tokens = agree_on_tokens
        self._argmax = argmax
        self.kv_cache = kv_cache
        self.limits = limits
        self.backend = backend
        self.requests: dict[str, RequestState] = {}
        self.handles: dict[int, RequestState] = {}
        # Who holds each recurrent-state slot (models with recurrent layers only).
        self.slot_holders: dict[int, RequestState] = {}
        # Slots that hold a checkpoint a plan asked for (StepPlan.state_checkpoints), which a
        # NewRequest may resume from until a request takes the slot.
        self.checkpointed: set[int] = set()
        # Slots an import wrote a moved request's state into (KvImport.state_slot), which a
        # NewRequest with state_in_slot may start from until a request or checkpoint takes them.
        self.imported: set[int] = set()
        self.rows = RequestRows(limits.vocab_size, loaded.device, row_kernels)
        self._use_logits_to_keep = accepts_logits_to_keep(loaded)
        self._steady = SteadyDecodes()
        # Tokens computed so far by steps that did not fail: prompt, then decode.
        self._computed = [0, 0]
        # Unseeded draws share this generator; seeded requests own theirs.
        self._generator = torch.Generator(device=loaded.device)
        self._generator.seed()

    def execute(self, plan: executor_pb2.StepPlan, late: LateBitmasks | None = None) -> executor_pb2.StepResult:
        """late: where the bitmasks of entries with bitmask_follows come from (the plan's
        stream); without it (a tensor-parallel follower, whose tokens rank 0 decides) such
        entries sample unconstrained."""
        started = time.perf_counter()
        for request_id in plan.dropped_request_ids:
            # Unknown ids are fine: the scheduler pipelines and may drop what is already gone.
            self._forget(request_id)
        unfilled = run_swaps(plan, self.host, self.limits)
        unfilled |= self._copy_blocks(plan, unfilled)
        admitted = self._admit(plan, unfilled)
        result = executor_pb2.StepResult(step_id=plan.step_id, rejected=admitted.rejected)
        if admitted.work or admitted.steady is not None:
            prompt, total = admitted.prompt_tokens(), admitted.num_tokens()
            try:
                self._run(admitted, result, late)
            except Exception as error:
                self._fail_step(plan.step_id, admitted.states(), error, result)
            else:
                self.checkpointed.update(slot for item in admitted.work for _, slot in item.checkpoints)
                self._computed[0] += prompt
                self._computed[1] += total - prompt
        elif admitted.decodes:
            result.decode_token_ids.extend([UNHELD_DECODE_TOKEN] * len(admitted.decodes))
        if plan.want_held_requests:
            result.held_requests.extend(
                executor_pb2.HeldRequest(
                    request_id=state.request_id,
                    block_ids=state.block_ids,
                    num_computed_tokens=state.num_computed_tokens,
                    state_slot=state.state_slot,
                )
                for state in self.requests.values()
            )
        result.step_time_s = time.perf_counter() - started
        if logger.isEnabledFor(logging.DEBUG):
            logger.debug(
                "event=step step_id=%d requests=%d tokens=%d sampled=%d rejected=%d "
                "forward_s=%.4f step_s=%.4f",
                plan.step_id,
                len(admitted.states()),
                admitted.num_tokens(),
                len(result.outputs) + len(result.decode_token_ids),
                len(result.rejected),
                result.forward_time_s,
                result.step_time_s,
            )
        return result

    def drop_all_requests(self, wipe_kv: bool = False) -> None:
        """Forgets every request, for a scheduler that starts over and resends them all;
        wipe_kv zeroes the K/V too, for a new holder that must not read the last one's."""
        logger.info("event=requests_dropped count=%d wipe_kv=%s", len(self.requests), wipe_kv)
        self.requests.clear()
        self.handles.clear()
        self.slot_holders.clear()
        self.checkpointed.clear()
        self.imported.clear()
        self.rows.clear()
        if wipe_kv:
            self.kv_cache.wipe()
            if self.draft is not None:
                self.draft.kv_cache.wipe()
            if self.host is not None:
                self.host.forget_all()
            if self.loaded.recurrent is not None and self.loaded.recurrent.states is not None:
                self.loaded.recurrent.states.wipe()

    def graphed_steps(self) -> int:
        """Steps so far whose logits came from a CUDA graph."""
        return self.graphs.graphed_steps if self.graphs is not None else 0

    def state_slots_in_use(self) -> tuple[int, int]:
        """Recurrent-state slots held by requests, and holding checkpoints."""
        return len(self.slot_holders), len(self.checkpointed)

    def num_kv_blocks_in_use(self) -> int:
        return len({block for state in self.requests.values() for block in state.block_ids})

    def computed_tokens(self) -> tuple[int, int]:
        """Prompt and decode tokens computed so far by steps that did not fail."""
        return self._computed[0], self._computed[1]

    def swapped_blocks(self) -> tuple[int, int]:
        """Blocks copied so far out of the device into the host tier, and back in."""
        return (self.host.swapped[0], self.host.swapped[1]) if self.host is not None else (0, 0)

    def read_blocks(self, block_ids: list[int]) -> bytes:
        """These blocks' K/V, for another executor (KvTransfer.FetchBlocks)."""
        return self.kv_cache.read_blocks(block_ids)

    def write_blocks(self, block_ids: list[int], data: bytes) -> None:
        """Another executor's K/V of as many blocks, into these (an import)."""
        self.kv_cache.write_blocks(block_ids, data)

    def read_state(self, slot: int) -> bytes:
        """One slot's recurrent state, for another executor (KvBlockChunk.state)."""
        return read_slot(self._states(), slot)

    def write_state(self, slot: int, data: bytes) -> None:
        """Another executor's recurrent state of one request, into a slot no request holds (an
        import); ValueError, writing nothing, when a request holds it or the bytes are not one
        slot's. A checkpoint the slot held is gone."""
        holder = self.slot_holders.get(slot)
        if holder is not None:
            raise ValueError(f"state_slot {slot} is held by request {holder.request_id!r}")
        write_slot(self._states(), slot, data)
        self.checkpointed.discard(slot)
        self.imported.add(slot)

    def _states(self) -> StateSlots:
        recurrent = self.loaded.recurrent
        if recurrent is None or recurrent.states is None:
            raise ValueError("the model has no recurrent layers")
        return recurrent.states

    def _gathers_decodes(self) -> bool:
        """Whether steady decodes take their inputs from the rows' tables: where a decode graph
        or the cpu_paged backend's attention metadata is built that way. Not for a model with
        recurrent layers, whose mixers take each step split by sequence (build_step_inputs)."""
        if self.loaded.sequence_rope or self.loaded.recurrent is not None:
            return False
        return self.graphs is not None or self.backend == "cpu_paged"

    def _forget(self, request_id: str) -> None:
        state = self.requests.pop(request_id, None)
        if state is None:
            return
        if self.handles.get(state.handle) is state:
            del self.handles[state.handle]
        if self.slot_holders.get(state.state_slot) is state:
            del self.slot_holders[state.state_slot]
        self.rows.release(state)

    def _run(self, admitted: _Admitted, result: executor_pb2.StepResult, late: LateBitmasks | None) -> None:
        """The shared part of a step: one forward and one sampling pass for all its work."""
        forward_started = time.perf_counter()
        steady = admitted.steady
        if any(item.num_model_drafts for item in admitted.work):
            admitted.work = self._with_model_drafts(admitted.work)
        # Read before the forward, which moves the requests' progress on.
        sampling = [item for item in admitted.work if item.samples] if steady is None else []
        logits = self._steady_logits(steady) if steady is not None else None
        if steady is not None and logits is not None:
            sampled_rows = steady.rows
        else:
            if steady is not None:
                # Outside every graph's bucket, on a backend whose inputs only build_step_inputs
                # makes: the decodes run as work.
                admitted.work = [ScheduledWork(state, 1) for state in steady.states]
                admitted.steady = None
            logits, sampled_states, sampled_rows, prompt_spans = self._work_logits(admitted.work)
            if prompt_spans:
                # The prompts' rows follow the sampled ones.
                self._score_prompts(logits[len(sampled_states) :], prompt_spans)
                logits = logits[: len(sampled_states)]
        batch = self.rows.sampling(sampled_rows, drafts_before_rows(sampling))
        masks = self._token_masks(result.step_id, sampling, late)
        if masks is not None:
            batch = replace(batch, token_masks=masks)
        sampled = sample_batch(logits, batch, self._generator, self._argmax)
        if self._agree_on_tokens is not None and sampled.token_ids:
            sampled.token_ids = self._agree_on_tokens(sampled.token_ids)
        result.forward_time_s = time.perf_counter() - forward_started
        if admitted.steady is not None:
            self.rows.decoded(sampled_rows, sampled.token_ids)
            result.decode_token_ids.extend(sampled.token_ids)
            return
        tokens = self._advance(admitted, sampled, result)
        if admitted.decodes:
            result.decode_token_ids.extend(
                [UNHELD_DECODE_TOKEN if s is None else tokens[s.request_id] for s in admitted.decodes]
            )

    def _with_model_drafts(self, work: list[ScheduledWork]) -> list[ScheduledWork]:
        """The work with the draft model's proposals as the drafts of the items that ask for them
        (ContinuingRequest.num_model_drafts, which validation lets through only with a draft model)."""
        assert self.draft is not None
        asking = [i for i, item in enumerate(work) if item.num_model_drafts]
        proposals = self.draft.propose([DraftRequest(work[i].state, work[i].num_model_drafts) for i in asking])
        work = list(work)
        for i, drafts in zip(asking, proposals, strict=True):
            work[i] = replace(work[i], draft_token_ids=tuple(drafts))
        return work

    def _token_masks(self, step_id: int, sampling: list[ScheduledWork], late: LateBitmasks | None) -> TokenMasks | None:
        """The step's grammar masks, placed by row among its sampling work (in work order, as
        both build_step_inputs and the decode graphs sample them); those that follow the plan
        waited for here, after the forward. An item's mask is for its first row; an item with
        drafts and masks (ContinuingRequest.draft_bitmasks) has one for each row after."""
        bitmasks = [item.allowed_token_bitmask for item in sampling]
        if late is not None and any(item.bitmask_follows for item in sampling):
            arrived = late.take(step_id)
            for i, item in enumerate(sampling):
                if item.bitmask_follows:
                    bitmask = arrived.get(item.state.request_id, b"")
                    problem = bitmask_problem(bitmask, self.limits)
                    if problem is not None:
                        raise ValueError(f"request {item.state.request_id!r}'s late bitmask: {problem}")
                    bitmasks[i] = bitmask
        first_rows = np.cumsum([0] + [item.num_samples for item in sampling[:-1]]).tolist()
        rows: list[int] = []
        masks: list[bytes] = []
        for i, (item, bitmask) in enumerate(zip(sampling, bitmasks, strict=True)):
            if bitmask:
                rows.append(first_rows[i])
                masks.append(bitmask)
            rows.extend(range(first_rows[i] + 1, first_rows[i] + 1 + len(item.draft_bitmasks)))
            masks.extend(item.draft_bitmasks)
        if not rows:
            return None
        return token_masks_of(rows, masks, self.limits.vocab_size, self.loaded.device)

    def _steady_logits(self, steady: SteadyStep) -> torch.Tensor | None:
        """A steady step's logits from inputs gathered from the rows' tables, or None where
        neither a decode graph nor the cpu_paged backend takes them."""
        if self.graphs is not None:
            logits = self.graphs.steady_logits(self.rows, steady)
            if logits is not None:
                return logits
        if self.backend != "cpu_paged":
            return None
        inputs = build_decode_inputs(self.rows, steady, self.kv_cache)
        return compute_logits(self.loaded, inputs, self._use_logits_to_keep)

    def _work_logits(
        self, work: list[ScheduledWork]
    ) -> tuple[torch.Tensor, list[RequestState], np.ndarray, list[PromptSpan]]:
        """The logits of a step's work, with the requests they sample and their rows, then the
        rows of the prompts it scores."""
        logits = self.graphs.logits(work) if self.graphs is not None else None
        if logits is not None:
            # A graphed step is all decodes, every one sampled, in work order.
            states = [item.state for item in work]
            return logits, states, np.array([state.row for state in states], dtype=np.int64), []
        inputs = build_step_inputs(
            work, self.kv_cache, self.backend, self.loaded.device, self.loaded.sequence_rope, self.loaded.recurrent is not None
        )
        logits = compute_logits(self.loaded, inputs, self._use_logits_to_keep)
        return logits, inputs.sampled, inputs.sampled_rows, inputs.prompt_spans

    def _score_prompts(self, logits: torch.Tensor, spans: list[PromptSpan]) -> None:
        """Each scored prompt token's logprob under the model's raw distribution, and its most
        likely alternatives, kept on its request until the step that samples after the prompt."""
        logprobs = torch.log_softmax(logits.float(), dim=-1)
        targets = [token for span in spans for token in span.state.tokens(span.first + 1, span.first + 1 + span.count)]
        widths = [span.state.sampling.num_prompt_logprobs for span in spans for _ in range(span.count)]
        tops = top_logprobs(logprobs, torch.tensor(targets, device=logprobs.device), widths)
        records = [_logprob_record(token, top) for token, top in zip(targets, tops, strict=True)]
        start = 0
        for span in spans:
            span.state.prompt_logprobs.extend(records[start : start + span.count])
            start += span.count

    def _fail_step(
        self,
        step_id: int,
        states: list[RequestState],
        error: Exception,
        result: executor_pb2.StepResult,
    ) -> None:
        """A forward that raised is this step's failure, not the executor's: the step's requests
        may have been advanced or half-written, so their state goes and the scheduler decides
        whether to recompute them; every other request keeps its state."""
        logger.exception(
            "event=step_failed step_id=%d requests=%d error=%r", step_id, len(states), error
        )
        failed = [state.request_id for state in states]
        for request_id in failed:
            self._forget(request_id)
        del result.outputs[:]
        del result.decode_token_ids[:]
        result.failure.CopyFrom(
            executor_pb2.StepFailure(message=f"{type(error).__name__}: {error}", request_ids=failed)
        )

    def _copy_blocks(self, plan: executor_pb2.StepPlan, unfilled: dict[int, str]) -> dict[int, str]:
        """Makes the plan's block copies. Returns the device blocks they should have filled but
        did not, each with why: all their destinations when anything is wrong with them, else
        those copied from a block that a refused swap-in (unfilled) should have filled."""
        sources, destinations = plan.copy_block_sources, plan.copy_block_destinations
        if not sources and not destinations:
            return {}
        problem = copies_problem(plan, self.limits)
        if problem is not None:
            return dict.fromkeys(destinations, f"the plan's block copies: {problem}")
        self.kv_cache.copy_blocks(list(sources), list(destinations))
        return {target: unfilled[source] for source, target in zip(sources, destinations) if source in unfilled}

    def _admit(self, plan: executor_pb2.StepPlan, unfilled: dict[int, str]) -> _Admitted:
        """unfilled: device blocks the plan's swaps or copies should have filled but did not, with
        why; a new request that reads one is refused (a scheduler's bug, INTERNAL)."""
        admitted = _Admitted(work=[], rejected=[], decodes=[])
        scheduled: set[str] = set()
        entries = [*plan.new_requests, *plan.continuing_requests]
        for entry in entries:
            if unfilled and isinstance(entry, executor_pb2.NewRequest):
                problem = next((unfilled[block] for block in entry.block_ids if block in unfilled), None)
                if problem is not None:
                    self._reject(admitted, entry.request_id, rpc_codes.INTERNAL, problem)
                    continue
            try:
                problem = self._admit_entry(entry, admitted, scheduled)
            except Exception as error:
                # A bug tripped by one entry must not take the stream (and every other request)
                # down with it; the scheduler aborts just this request.
                logger.exception("event=entry_failed request_id=%s", entry.request_id)
                self._reject(
                    admitted, entry.request_id, rpc_codes.INTERNAL, f"executor error: {error!r}"
                )
                continue
            if problem is not None:
                self._reject(admitted, entry.request_id, rpc_codes.INVALID_ARGUMENT, problem)
        admitted.num_entries = len(admitted.work)
        self._admit_decodes(plan, admitted, scheduled)
        if plan.state_checkpoints:
            self._attach_checkpoints(plan, admitted)
        return admitted

    def _attach_checkpoints(self, plan: executor_pb2.StepPlan, admitted: _Admitted) -> None:
        """Gives each work item the checkpoints the plan asks of it. One that cannot be made is
        logged and not made, so a request that later names its slot as state_source_slot is
        refused rather than resumed from another state: the scheduler's bug, or its request
        refused earlier in this plan (the scheduler then drops the checkpoint itself)."""
        index = {item.state.request_id: i for i, item in enumerate(admitted.work)}
        for checkpoint in plan.state_checkpoints:
            position = index.get(checkpoint.request_id)
            if position is None:
                problem = "the request computes nothing in this step"
            else:
                item = admitted.work[position]
                start = item.state.num_computed_tokens
                problem = checkpoint_problem(checkpoint, start, start + item.num_tokens, self.slot_holders, self.limits)
            if problem is not None:
                logger.warning(
                    "event=state_checkpoint_refused request_id=%s slot=%d problem=%r",
                    checkpoint.request_id, checkpoint.slot, problem,
                )
                continue
            self.checkpointed.discard(checkpoint.slot)
            self.imported.discard(checkpoint.slot)
            point = (checkpoint.num_tokens - start, checkpoint.slot)
            admitted.work[position] = replace(item, checkpoints=(*item.checkpoints, point))

    def _admit_decodes(
        self, plan: executor_pb2.StepPlan, admitted: _Admitted, scheduled: set[str]
    ) -> None:
        """Steady decodes by handle: their appended blocks first, then one token each."""
        if len(plan.decode_block_handles) != len(plan.decode_block_ids):
            problem = "decode_block_handles and decode_block_ids differ in length"
            for handle in plan.decode_handles:
                state = self.handles.get(handle)
                if state is not None:
                    self._reject(admitted, state.request_id, rpc_codes.INVALID_ARGUMENT, problem)
            admitted.decodes.extend([None] * len(plan.decode_handles))
            return
        refused: dict[int, str] = {}
        for handle, block_id in zip(plan.decode_block_handles, plan.decode_block_ids):
            state = self.handles.get(handle)
            if state is None or handle in refused:
                continue
            problem = check_decode_block(block_id, state, self.limits)
            if problem is None:
                self.rows.add_blocks(state, (block_id,))
            else:
                refused[handle] = problem
        if self._gathers_decodes() and not admitted.work and not refused:
            steady = self._steady.admit(plan.decode_handles, self.handles, self.rows, self.limits)
            if steady is not None:
                admitted.steady = steady
                admitted.decodes = list(steady.states)
                return
        for handle in plan.decode_handles:
            state = self.handles.get(handle)
            if state is None:
                admitted.decodes.append(None)
                continue
            problem = refused.get(handle) or check_decode(state, self.limits)
            if problem is None and state.request_id in scheduled:
                problem = "request scheduled twice in one plan"
            if problem is not None:
                self._reject(admitted, state.request_id, rpc_codes.INVALID_ARGUMENT, problem)
                admitted.decodes.append(None)
                continue
            scheduled.add(state.request_id)
            admitted.work.append(ScheduledWork(state, 1))
            admitted.decodes.append(state)

    def _admit_entry(
        self,
        entry: executor_pb2.NewRequest | executor_pb2.ContinuingRequest,
        admitted: _Admitted,
        scheduled: set[str],
    ) -> str | None:
        """Adds the entry's work to `admitted`, or says what is wrong with it."""
        sampling = None
        if isinstance(entry, executor_pb2.NewRequest):
            sampling = SamplerSettings.from_proto(entry.sampling)
            problem = check_new(entry, sampling, self.limits)
            state = None
        else:
            state = self.requests.get(entry.request_id)
            problem = check_continuing(entry, state, self.limits)
        if problem is None and entry.request_id in scheduled:
            problem = "request scheduled twice in one plan"
        if problem is not None:
            return problem
        if isinstance(entry, executor_pb2.NewRequest):
            assert sampling is not None  # parsed with the entry's checks above
            if entry.request_id in self.requests:
                logger.info("event=request_rebuilt request_id=%s", entry.request_id)
            self._forget(entry.request_id)
            if entry.handle and entry.handle in self.handles:
                return f"handle {entry.handle} names request {self.handles[entry.handle].request_id!r}"
            if entry.state_slot and entry.state_slot in self.slot_holders:
                return f"state_slot {entry.state_slot} is held by request {self.slot_holders[entry.state_slot].request_id!r}"
            source = entry.state_source_slot
            if source and source not in self.checkpointed:
                return f"state_source_slot {source} holds no checkpoint this executor made"
            if entry.state_in_slot and entry.state_slot not in self.imported:
                return f"state_slot {entry.state_slot} holds no state an import wrote (state_in_slot)"
            if source:
                assert self.loaded.recurrent is not None and self.loaded.recurrent.states is not None
                self.loaded.recurrent.states.copy_slot(source, entry.state_slot)
            # Nothing to do for state_in_slot: a request with computed tokens reads its state from
            # its slot (SlotStates), which the import wrote; only one from its first token starts empty.
            self.checkpointed.discard(entry.state_slot)
            self.imported.discard(entry.state_slot)
            state = _new_state(self.rows, entry, sampling, self.loaded.device)
            self.requests[entry.request_id] = state
            if entry.handle:
                self.handles[entry.handle] = state
            if entry.state_slot:
                self.slot_holders[entry.state_slot] = state
        else:
            assert state is not None  # check_continuing refuses an unknown id
            self.rows.add_blocks(state, entry.new_block_ids)
        scheduled.add(entry.request_id)
        continuing = isinstance(entry, executor_pb2.ContinuingRequest)
        follows = continuing and entry.bitmask_follows
        drafts = tuple(entry.draft_token_ids) if continuing else ()
        model_drafts = entry.num_model_drafts if continuing else 0
        admitted.work.append(
            ScheduledWork(
                state,
                entry.num_scheduled_tokens,
                entry.allowed_token_bitmask,
                follows,
                draft_token_ids=drafts,
                num_model_drafts=model_drafts,
                draft_bitmasks=tuple(entry.draft_bitmasks) if continuing else (),
            )
        )
        return None

    def _reject(self, admitted: _Admitted, request_id: str, code: int, problem: str) -> None:
        # A request that was scheduled earlier in this plan keeps running; any other state of
        # that id goes, so the scheduler rebuilds it from a fresh NewRequest.
        if not any(w.state.request_id == request_id for w in admitted.work):
            self._forget(request_id)
        logger.warning(
            "event=entry_rejected request_id=%s code=%d problem=%r", request_id, code, problem
        )
        admitted.rejected.append(
            executor_pb2.RejectedRequest(
                request_id=request_id, code=code, message=f"request {request_id!r}: {problem}"
            )
        )

    def _advance(
        self,
        admitted: _Admitted,
        sampled: SampleResult,
        result: executor_pb2.StepResult,
    ) -> dict[str, int]:
        """Advances each request past its work and appends what it sampled; the sampled rows
        are the sampling items' in work order, ScheduledWork.num_samples each. An item with
        drafts keeps the drafts its rows accept and the token sampled after the last of them,
        and has computed its last token and those drafts: it ends as decodes one at a time
        would have left it, the K/V of the positions after them left for the next step to
        overwrite. Entries' tokens go into result.outputs; steady decodes' tokens are returned
        by request id, for decode_token_ids."""
        decoded: dict[str, int] = {}
        # Requests that sampled one token, appended in one call (counting penalties).
        single_rows: list[int] = []
        single_tokens: list[int] = []
        cursor = 0
        for index, item in enumerate(admitted.work):
            state = item.state
            width = item.num_samples
            if not width:
                self.rows.advance(state, item.num_tokens)
                if index < admitted.num_entries:
                    result.outputs.add(request_id=state.request_id)
                continue
            tokens = sampled.token_ids[cursor : cursor + width]
            logprobs = sampled.logprobs[cursor : cursor + width]
            cursor += width
            drafts = item.draft_token_ids
            accepted = accepted_drafts(drafts, tokens)
            tokens, logprobs = tokens[: accepted + 1], logprobs[: accepted + 1]
            self.rows.advance(state, item.num_tokens - (len(drafts) - accepted))
            if item.num_model_drafts:
                # The draft model's K/V past the tokens kept were of rejected drafts.
                state.num_draft_computed = min(state.num_draft_computed, state.num_computed_tokens)
            if drafts:
                self.rows.extend_tokens(state, tokens)
                # The blocks past its computed tokens held only rejected drafts: the scheduler
                # takes them back (ContinuingRequest.draft_token_ids).
                self.rows.keep_blocks(state, -(-state.num_computed_tokens // self.kv_cache.block_size))
                logger.debug(
                    "event=drafts_verified request_id=%s drafts=%d accepted=%d", state.request_id, len(drafts), accepted
                )
            else:
                single_rows.append(state.row)
                single_tokens.append(tokens[0])
            if index >= admitted.num_entries:
                decoded[state.request_id] = tokens[0]
                continue
            output = result.outputs.add(request_id=state.request_id)
            if state.prompt_logprobs:
                output.prompt_logprobs.extend(state.prompt_logprobs)
                state.prompt_logprobs.clear()
            output.token_ids.extend(tokens)
            output.logprobs.extend(
                _logprob_record(token, top) for token, top in zip(tokens, logprobs, strict=True) if top is not None
            )
        if cursor != len(sampled.token_ids):
            raise ValueError(f"{len(sampled.token_ids)} sampled rows for the {cursor} the step's work samples")
        self.rows.append_tokens(np.array(single_rows, dtype=np.int64), single_tokens)
        return decoded


def _logprob_record(token: int, logprobs: TopLogprobs) -> executor_pb2.TokenLogprob:
    return executor_pb2.TokenLogprob(
        token_id=token,
        logprob=logprobs.token_logprob,
        top_token_ids=logprobs.top_token_ids,
        top_logprobs=logprobs.top_logprobs,
    )


def _new_state(
    rows: RequestRows, entry: executor_pb2.NewRequest, params: SamplerSettings, device: torch.device
) -> RequestState:
    return rows.admit(
        request_id=entry.request_id,
        token_ids=entry.token_ids,
        # Older schedulers leave it 0: then every token counts as prompt.
        num_prompt_tokens=entry.num_prompt_tokens or len(entry.token_ids),
        block_ids=entry.block_ids,
        num_computed_tokens=entry.num_computed_tokens,
        sampling=params,
        generator=make_generator(params.seed, device),
        handle=entry.handle,
        state_slot=entry.state_slot,
    )
