"""Speculative decoding, the scheduler's side: which running requests get drafts in a step, how
many, from which proposer, and what each verification says.

The executor verifies (executor.proto, ContinuingRequest.draft_token_ids): it computes a
request's last sampled token and the drafts after it as one chunk, samples at every position as a
decode of that position would, and answers the drafts it accepted (each equal to the token
sampled before it) and the token sampled after the last of them. So greedy outputs, and seeded
ones, are exactly those of decoding one token at a time; the step just yields 1..k+1 tokens.

Proposers: ngram and suffix propose here (the drafts travel in the plan); draft leaves it to the
executor's draft model (ContinuingRequest.num_model_drafts: the plan says how many), which
proposes and verifies in the same step. The rule below is the same for all three; the draft
method always has a proposal.

Who gets drafts in a step (the rule):
- speculation is on: SchedulerConfig.num_speculative_tokens (the flag's K) > 0, which the lane
  sets only for an executor that supports_draft_tokens, and never for a hybrid model;
- the request may take drafts under the contract: its min_tokens reached (any repetition,
  presence or frequency penalty is fine: the executor counts the drafts before a position as a
  decode there would); it is not being retried alone after a failed step; and with a grammar,
  its drafts come from here (ngram, suffix; the executor's draft model does not know it): they
  are cut before the first token the grammar does not allow (or that ends it), and the step
  carries the grammar's mask at each position (ContinuingRequest.draft_bitmasks);
- every step of it in flight has answered: drafts follow its last token, which must be known;
- the step's decode batch (running requests past their prompt) is below speculative_max_batch:
  a batch that large keeps the accelerator busy on its own, and verifying drafts would take
  compute from plain decodes, so then no request gets any;
- its drafts fit in the step's token budget left once every running request has its own token
  or prefill chunk (in rank order, before waiting requests are admitted), and free blocks hold
  them: drafts never preempt anyone;
- with the draft method, drafting pays for it: its estimate says a verify yields two tokens or
  more (e >= 1), or it has decoded its probe interval of tokens without drafts since its last
  verify (a probe, so that acceptance that recovers is noticed). The interval starts at
  PROBE_AFTER and doubles, up to MAX_PROBE_AFTER, with each probe that accepts nothing (a draft
  model that is seldom right costs a few probes per request, not one per PROBE_AFTER tokens: a
  probe holds its step's whole batch to it, and the draft model's first catches up on the
  request's tokens); any accepted draft brings it back. ngram and suffix are not gated so: their
  proposal costs nothing to make and, when wrong, only its rows of the verify step, and they
  propose only where the request's tokens hold a match (gating them too cut the quote workload's
  decode-step gain from 1.46x to 1.31x in process, bench/speculation_split.py); the draft model
  always has a proposal, and each costs its forwards;
- the proposer has a proposal: it gets min(the request's K, budget left, tokens left before its
  length limit less one) tokens of it.

Each request's K adapts to its acceptance: after a verify that accepted a drafts its estimate e
of drafts accepted per verify moves to e + ALPHA * (a - e), and K becomes round(e) + 1 within
1..the flag's K: one more than the request has lately been accepting, so full acceptance climbs
back to the flag and none keeps one draft. A new request starts from the proposer's recent
acceptance over every request (an average over all verifies with the slower weight
RECENT_ALPHA, from the flag's K), not from the flag's K: where the proposer has lately been
wrong, as a draft model that is seldom right, a new request starts with a probe rather than with
a run of verifies of K drafts that fail.

Pipelining: no drafts can be planned for a request while a step of it is in flight (they would
follow a token not yet known). A request with drafts in flight sits out the steps planned
meanwhile, and so does every request that may take drafts while any drafts are in flight: its
plain decode pipelined then would make a step of its own beside theirs, and a small batch's step
costs mostly the same whatever its tokens (SmolLM2 on one CPU thread: 12.4 ms for one token,
15.4 for four, 38 for twenty), so the requests that speculate step together. Otherwise one with
a plain decode in flight sits out (so that its next step can carry drafts) only when drafting
pays for it (the rule above) and the proposer already has something for it; else it decodes as
without speculation. A request whose drafts do not pay thus decodes plain, pipelined, between
probes, whatever proposes: the executor's draft model always has a proposal, and a draft that is
seldom right would otherwise hold every request to unpipelined verify steps of one token.

A request that may take drafts decodes one entry at a time (a ContinuingRequest), never in the
bulk decode set (decode_set.py), while speculation is on; one with no proposal decodes one token.
"""

from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from typing import Protocol

from scheduler_service.core.config import SchedulerConfig
from scheduler_service.core.ngram_proposer import NgramProposer
from scheduler_service.core.request import Request
from scheduler_service.core.stop_checker import length_limit
from scheduler_service.core.suffix_proposer import SuffixProposer, SuffixTable

# Weight of the latest verify in a request's acceptance estimate, and in the proposer's over
# every request (which a run of one request's rejections must not sink).
ALPHA = 0.5
RECENT_ALPHA = 0.1
# Plain decodes a request pipelines, while its estimate says waiting does not pay, before it
# waits once to try drafts again; doubled after each probe that accepts nothing, up to
# MAX_PROBE_AFTER.
PROBE_AFTER = 16
MAX_PROBE_AFTER = 256


@dataclass(slots=True, frozen=True)
class Drafts:
    """One request's drafts in a step: the tokens proposed here, or how many the executor's
    draft model is to propose."""

    token_ids: tuple[int, ...] = ()
    from_model: int = 0
    # For a request with a grammar: its mask at the position of its last token, then after each
    # draft (TokenConstraint.draft_bitmasks).
    bitmasks: tuple[bytes, ...] = ()

    def __len__(self) -> int:
        return len(self.token_ids) or self.from_model


class Proposer(Protocol):
    def propose(self, request: Request, k: int) -> list[int]: ...

    def leave(self, request: Request) -> None: ...


@dataclass(slots=True)
class _Drafting:
    """One request's speculation."""

    k: int
    # Drafts accepted per verify, lately (see ALPHA).
    accepted: float
    # Its preemption count when its drafts in flight were planned (-1: none in flight): a
    # preemption makes them stale, and they are never answered here.
    in_flight_epoch: int = -1
    # Plain decodes pipelined since its last verify, and how many make a probe due.
    plain: int = 0
    probe_after: int = PROBE_AFTER


class Speculation:
    def __init__(self, config: SchedulerConfig, table: SuffixTable | None = None) -> None:
        self.max_k = config.num_speculative_tokens
        self.max_batch = config.speculative_max_batch
        self.max_seq_len = config.max_seq_len
        self.enabled = self.max_k > 0
        self.method = config.speculative_method
        # None: the executor's draft model proposes.
        self.proposer: Proposer | None = None
        if self.method == "suffix":
            self.proposer = SuffixProposer(table if table is not None else SuffixTable())
        elif self.method == "ngram":
            self.proposer = NgramProposer()
        self._requests: dict[Request, _Drafting] = {}
        # Whether the step being planned may carry drafts (the batch rule; begin_step), and
        # whether drafts are in flight then.
        self.allowed = False
        self.verifying = False
        # Since start: entries verified, drafts sent in them, drafts accepted.
        self.num_verified = 0
        self.num_draft_tokens = 0
        self.num_accepted_tokens = 0
        # Drafts accepted per verify lately, over every request: a new request's estimate.
        self._recent = float(self.max_k)

    def applies_to(self, request: Request) -> bool:
        """Whether the request may ever take drafts here (all but its min_tokens, which it
        reaches in time)."""
        if not self.enabled or request.retry_alone:
            return False
        if request.grammar is None and request.sampling.structured_output is None:
            return True
        return request.grammar is not None and self.proposer is not None

    def begin_step(self, running: Iterable[Request]) -> None:
        """The batch rule for the step about to be planned."""
        if not self.enabled:
            return
        decoding = 0
        for request in running:
            decoding += not request.in_prefill
            if decoding >= self.max_batch:
                break
        self.allowed = decoding < self.max_batch
        self.verifying = self.allowed and any(
            state.in_flight_epoch == request.num_preemptions for request, state in self._requests.items()
        )

    def sits_out(self, request: Request) -> bool:
        """Whether a request with a step in flight is left out of the step being planned (see
        Pipelining in the module docstring)."""
        if not self.enabled:
            return False
        state = self._requests.get(request)
        if state is not None and state.in_flight_epoch == request.num_preemptions:
            return True
        if not self.allowed or not self._may_draft(request):
            return False
        if self.verifying:
            # Its plain decode pipelined now would run in a step of its own beside the drafts'
            # (a step's cost is mostly fixed on a small batch): it joins their next step instead.
            return True
        state = self._state(request)
        if self._pays(state) and self._has_proposal(request):
            return True
        state.plain += 1
        return False

    def drafts_for(self, request: Request, budget: int) -> Drafts:
        """Drafts for a request whose step computes its last token and whose earlier steps have
        all answered, at most budget of them; none when the rule says so."""
        if not self.allowed or not self._may_draft(request):
            return Drafts()
        state = self._state(request)
        if self.proposer is None and not self._pays(state):
            state.plain += 1
            return Drafts()
        k = min(state.k, budget, length_limit(request, self.max_seq_len) - request.num_tokens - 1)
        if k <= 0:
            return Drafts()
        if self.proposer is None:
            return Drafts(from_model=k)
        tokens = self.proposer.propose(request, k)
        if request.grammar is None or not tokens:
            return Drafts(tuple(tokens))
        masks = request.grammar.draft_bitmasks(tokens)
        allowed = len(masks) - 1
        return Drafts(tuple(tokens[:allowed]), bitmasks=tuple(masks)) if allowed else Drafts()

    def sent(self, request: Request) -> None:
        """Its drafts are in the plan being made."""
        self._requests[request].in_flight_epoch = request.num_preemptions

    def verified(self, request: Request, drafts: Drafts, tokens: Sequence[int]) -> str | None:
        """Takes the executor's answer to drafts: the accepted drafts and the token after them.
        Returns what is wrong with it, or None (then the request's K has adapted)."""
        accepted = len(tokens) - 1
        if not 0 <= accepted <= len(drafts):
            return f"{len(tokens)} tokens answer {len(drafts)} drafts"
        if drafts.token_ids and list(tokens[:accepted]) != list(drafts.token_ids[:accepted]):
            return f"{list(tokens)} is not a run of the drafts {list(drafts.token_ids)} and one token"
        state = self._requests[request]
        probe = not self._pays_by_estimate(state)
        state.in_flight_epoch, state.plain = -1, 0
        state.accepted += ALPHA * (accepted - state.accepted)
        state.k = self._k(state.accepted)
        self._recent += RECENT_ALPHA * (accepted - self._recent)
        if accepted:
            state.probe_after = PROBE_AFTER
        elif probe:
            state.probe_after = min(2 * state.probe_after, MAX_PROBE_AFTER)
        self.num_verified += 1
        self.num_draft_tokens += len(drafts)
        self.num_accepted_tokens += accepted
        return None

    def k_of(self, request: Request) -> int:
        """The request's K now (the flag's until it has been verified)."""
        state = self._requests.get(request)
        return state.k if state is not None else self.max_k

    def leave(self, request: Request) -> None:
        """The request left this scheduler (finished, moved, its executor lost)."""
        self._requests.pop(request, None)
        if self.proposer is not None:
            self.proposer.leave(request)

    @staticmethod
    def _pays_by_estimate(state: _Drafting) -> bool:
        return state.accepted >= 1

    def _pays(self, state: _Drafting) -> bool:
        return self._pays_by_estimate(state) or state.plain >= state.probe_after

    def _has_proposal(self, request: Request) -> bool:
        return self.proposer is None or bool(self.proposer.propose(request, 1))

    def _may_draft(self, request: Request) -> bool:
        return self.applies_to(request) and request.num_output_tokens >= request.sampling.min_tokens

    def _state(self, request: Request) -> _Drafting:
        state = self._requests.get(request)
        if state is None:
            state = self._requests[request] = _Drafting(self._k(self._recent), self._recent)
        return state

    def _k(self, estimate: float) -> int:
        return max(1, min(self.max_k, int(estimate + 0.5) + 1))
