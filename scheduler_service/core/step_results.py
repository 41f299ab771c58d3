"""The scheduler's side of a step's answer: the sampled tokens appended to their requests,
stops, errors and failed steps, the blocks the step filled entered into the prefix cache, and
the bitmasks that were waiting on its tokens.

A mixin of Scheduler (core/scheduler.py), kept apart as scheduler_moves.py is, so that planning
a step and taking in its answer each read in one file; it works on the scheduler's own books.
"""

from collections.abc import Callable, Sequence
from dataclasses import dataclass

from kv_manager import KVCacheManager
from protos.limits import UNHELD_DECODE_TOKEN
from scheduler_service.core.checkpoint_policy import CheckpointPolicy
from scheduler_service.core.config import SchedulerConfig
from scheduler_service.core.decode_set import BulkStep, DecodeSet
from scheduler_service.core.errors import ErrorKind, RequestError
from scheduler_service.core.move_books import MoveBooks
from scheduler_service.core.prefix_tracker import PrefixTracker
from scheduler_service.core.request import FinishReason, Request
from scheduler_service.core.speculation import Drafts, Speculation
from scheduler_service.core.step_plan import (
    LateBitmasks,
    RequestUpdate,
    StepOutput,
    StepUpdates,
)
from scheduler_service.core.stop_checker import check_stop, stop_reason_of_bulk_decode


@dataclass(slots=True, frozen=True)
class InFlight:
    """A request's part in a plan not yet answered."""

    request: Request
    # Its preemption count when planned: a preempted request's old outputs are stale.
    epoch: int
    # Tokens computed once the step has run.
    num_computed_tokens: int
    # Whether the step samples a token for it.
    samples: bool
    # Drafts it verifies (speculation.py).
    drafts: Drafts = Drafts()


class StepResults:
    """What it uses of the Scheduler it is mixed into."""

    config: SchedulerConfig
    eos_token_ids: frozenset[int]
    clock: Callable[[], float]
    kv: KVCacheManager
    requests: dict[str, Request]
    decodes: DecodeSet
    speculation: Speculation
    _checkpoints: CheckpointPolicy
    _prefixes: PrefixTracker
    _moves: MoveBooks
    _retrying: dict[Request, None]
    _in_flight: dict[int, dict[str, InFlight]]
    _in_flight_bulk: dict[int, BulkStep]
    _kept_bulk: dict[int, list[tuple[int, Request, int]]]
    _late: dict[int, list[tuple[Request, int]]]
    finish: Callable[..., None]
    _preempt: Callable[..., None]
    _import_done: Callable[[str, bool], Request | None]

    def update(self, output: StepOutput) -> StepUpdates:
        """Appends the step's sampled tokens, finishes requests that hit a stop condition, and
        enters the blocks the step filled into the prefix cache (only now: a block whose step
        was refused, failed or lost must never be found by another request), with a hybrid
        model's checkpoints the step kept."""
        result = StepUpdates()
        updates = result.updates
        failed: list[Request] = []
        now = self.clock()
        bulk = self._in_flight_bulk.pop(output.step_id, None)
        if bulk is not None:
            if output.failure is not None:
                failed.extend(self.decodes.live(bulk))
            else:
                self._apply_bulk(bulk, output, result, now)
        for position, request, epoch in self._kept_bulk.pop(output.step_id, ()):
            if self.requests.get(request.request_id) is not request or request.num_preemptions != epoch:
                continue
            tokens = output.decode_token_ids
            if output.failure is not None:
                failed.append(request)
            elif position >= len(tokens) or tokens[position] == UNHELD_DECODE_TOKEN:
                message = f"the executor returned no token for request {request.request_id}"
                updates.append(self._end_in_error(request, RequestError(ErrorKind.INTERNAL, message)))
            else:
                updates.append(self._append_tokens(request, output, now, result.inter_token_gaps, [tokens[position]]))
        for request_id, sent in self._in_flight.pop(output.step_id, {}).items():
            request = sent.request
            # The request may have finished, been preempted, or even been replaced by a new
            # request under the same id since this step was planned: its output is stale then.
            if self.requests.get(request_id) is not request or request.num_preemptions != sent.epoch:
                continue
            if request_id in output.rejected:
                rejection = output.rejected[request_id]
                message = f"the executor refused request {request_id}: {rejection.message}"
                updates.append(self._end_in_error(request, RequestError(rejection.kind, message)))
            elif output.failure is not None:
                failed.append(request)
            elif sent.samples and not output.sampled.get(request_id):
                message = f"the executor returned no token for request {request_id}"
                updates.append(self._end_in_error(request, RequestError(ErrorKind.INTERNAL, message)))
            elif sent.drafts and (wrong := self.speculation.verified(request, sent.drafts, output.sampled[request_id])):
                message = f"the executor's answer to request {request_id}'s drafts: {wrong}"
                updates.append(self._end_in_error(request, RequestError(ErrorKind.INTERNAL, message)))
            else:
                computed, tokens = sent.num_computed_tokens, request.token_ids
                if sent.drafts:
                    # Computed: its last token and the accepted drafts. The blocks past them held
                    # only rejected drafts: the executor's table drops them (the contract), and
                    # so does ours; a kept block's rejected K/V is overwritten by its next tokens.
                    sampled = output.sampled[request_id]
                    rejected = len(sent.drafts) + 1 - len(sampled)
                    request.num_computed_tokens -= rejected
                    computed -= rejected
                    self.kv.keep_tokens(request_id, computed)
                    tokens = [*tokens, *sampled[:-1]]
                    result.verified.append((request_id, len(sent.drafts), len(sampled) - 1))
                self.kv.cache_computed(request_id, tokens, computed)
                self._checkpoints.made(output.step_id, (request_id,))
                if computed >= request.prefill_target:
                    self._prefixes.computing.remove(request)
                if sent.samples:
                    if request.retry_alone:
                        request.retry_alone = False
                        del self._retrying[request]
                    updates.append(self._append_tokens(request, output, now, result.inter_token_gaps))
        if output.failure is not None:
            updates += self._step_failed(failed, output.failure)
        self._checkpoints.step_done(output.step_id)
        result.offers_ready = self._moves.served(output.step_id)
        for done in output.kv_imports_done:
            result.imports_done.append((done, self._import_done(done.transfer_id, done.ok)))
        self._late.pop(output.step_id, None)
        if self._late:
            result.late_bitmasks = self._late_bitmasks()
        return result

    def _late_bitmasks(self) -> list[LateBitmasks]:
        """The bitmasks of the steps in flight whose requests' earlier tokens are all in, in
        step order; requests that ended or lost their place since get none (the executor then
        samples them unconstrained, and their token is stale)."""
        ready = []
        for step_id, entries in list(self._late.items()):
            live = [
                request
                for request, epoch in entries
                if self.requests.get(request.request_id) is request and request.num_preemptions == epoch
            ]
            if any(request.num_pending_outputs > 1 for request in live):
                break
            del self._late[step_id]
            bitmasks = []
            for request in live:
                assert request.grammar is not None  # only constrained requests' bitmasks follow
                bitmasks.append((request.request_id, request.grammar.allowed_token_bitmask()))
            ready.append(LateBitmasks(step_id, bitmasks))
        return ready

    def _apply_bulk(self, bulk: BulkStep, output: StepOutput, result: StepUpdates, now: float) -> None:
        if len(output.decode_token_ids) != len(bulk.handles):
            message = (
                f"the executor answered {len(output.decode_token_ids)} decode tokens for "
                f"{len(bulk.handles)} decode handles"
            )
            for request in self.decodes.live(bulk):
                result.updates.append(self._end_in_error(request, RequestError(ErrorKind.INTERNAL, message)))
            return
        applied = self.decodes.apply(bulk, output.decode_token_ids, now)
        result.inter_token_gaps += applied.gaps.tolist()
        for request in applied.unheld:
            rejection = output.rejected.get(request.request_id)
            error = (
                RequestError(ErrorKind.INTERNAL, f"the executor does not hold request {request.request_id}")
                if rejection is None
                else RequestError(
                    rejection.kind, f"the executor refused request {request.request_id}: {rejection.message}"
                )
            )
            result.updates.append(self._end_in_error(request, error))
        filled = applied.filled
        request_ids = [request.request_id for request in filled.requests]
        unchained = self.kv.cache_next_blocks(request_ids, filled.num_computed, filled.packed_blocks)
        others = [*((filled.requests[i], filled.num_computed[i]) for i in unchained), *filled.others]
        for request, computed in others:
            self.kv.cache_computed(request.request_id, self.decodes.tokens_of(request), computed)
        self._checkpoints.made(output.step_id, [*request_ids, *(request.request_id for request, _ in filled.others)])
        for request, token in applied.stopped:
            self.finish(request, stop_reason_of_bulk_decode(request, token, self.eos_token_ids))
            result.updates.append(RequestUpdate(request, [token], [], True))
        result.decoded_requests, result.decoded_token_ids = applied.requests, applied.token_ids
        result.decoded_keys = applied.keys

    def _step_failed(self, requests: list[Request], failure: str) -> list[RequestUpdate]:
        """A failed step is retried once, alone (see Request.retry_alone); a request whose
        retry fails too is the cause, and ends with the executor's error. The others go back
        to the head of the queue, in arrival order, to be recomputed."""
        updates = []
        for request in sorted(requests, key=lambda r: r.arrival_index, reverse=True):
            if request.retry_alone:
                message = f"request {request.request_id} failed in the executor twice: {failure}"
                updates.append(self._end_in_error(request, RequestError(ErrorKind.INTERNAL, message)))
            else:
                request.retry_alone = True
                self._retrying[request] = None
                self._preempt(request)
        return updates

    def _end_in_error(self, request: Request, error: RequestError) -> RequestUpdate:
        self.finish(request, FinishReason.ABORT)
        return RequestUpdate(request, [], [], True, error)

    def _append_tokens(
        self, request: Request, output: StepOutput, now: float, gaps: list[float], sampled: Sequence[int] | None = None
    ) -> RequestUpdate:
        """sampled: the request's tokens, when not among the output's per-request ones (a
        steady decode's, kept across its swap-out)."""
        request.num_pending_outputs -= 1
        update = RequestUpdate(request, [], output.logprobs.get(request.request_id, []), False)
        prompt_records = output.prompt_logprobs.get(request.request_id, ()) if request.num_output_tokens == 0 else ()
        if request.sampling.max_tokens == 0:
            # The prompt alone was to be scored: the token sampled after it is not the client's.
            update.new_logprobs = list(prompt_records)
            self.finish(request, FinishReason.LENGTH)
            update.finished = True
            return update
        if prompt_records:
            update.new_logprobs = [*prompt_records, *update.new_logprobs]
        if sampled is None:
            sampled = output.sampled[request.request_id]
        if sampled:
            if request.last_token_at is not None:
                gaps.append(now - request.last_token_at)
            request.last_token_at = now
        grammar = request.grammar
        # Accepted drafts bring several tokens: those after a stop are dropped, with their logprobs.
        scored = len(prompt_records)
        for token in sampled:
            if grammar is not None and not grammar.accept(token):
                message = f"the executor sampled token {token}, which request {request.request_id}'s grammar does not allow"
                return self._end_in_error(request, RequestError(ErrorKind.INTERNAL, message))
            request.token_ids.append(token)
            update.new_token_ids.append(token)
            if request.first_token_time is None:
                request.first_token_time = now
            stop = check_stop(request, self.eos_token_ids, self.config.max_seq_len)
            if stop is not None:
                self.finish(request, *stop)
                update.finished = True
                update.new_logprobs = update.new_logprobs[: scored + len(update.new_token_ids)]
                break
        return update
