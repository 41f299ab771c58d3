"""A simulated executor: the real executor's bookkeeping with a deterministic stand-in for the
model, so the scheduler runs end to end in tests and policy benchmarks without torch.

It keeps a shadow KV cache (which token sits in which slot) and checks every plan against it the
way the attention would depend on it: a request's cached slots must hold exactly its tokens. A
scheduler that hands out a wrong block, a stale prefix hit or too few slots fails loudly here.
For a hybrid model (num_state_slots) it checks each new request's recurrent-state slot as the
real executor would: one it has, that no request it holds has, with an empty state to start from
or the state a checkpoint of an earlier plan kept for exactly the tokens the request resumes
after (state_source_slot); and each checkpoint a plan makes: in a slot no request it holds has,
at a point the request computes in that step. A checkpoint's state is modelled as the tokens it
follows. K/V moves between simulated executors (peers, by address): an offer makes blocks
readable, and an import copies the offered slots at the start of the next plan (as the real
executor writes fetched blocks between plans) and reports it in that plan's result. A host tier
is a second map of slots, which the plan's swap-outs and swap-ins copy to and from.
Draft tokens are verified as the contract says (executor.proto, ContinuingRequest.draft_token_ids):
every position computed, the model's token at each compared with the draft after it, and the
accepted drafts and the token after them answered; the blocks past the computed tokens, which
held only rejected drafts, leave the request's table (the rest of their K/V stays in the slots
until overwritten). A simulated draft model (draft_token) proposes the drafts of entries that ask
for num_model_drafts, each its guess after the tokens before it.
"""

from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

from protos.limits import UNHELD_DECODE_TOKEN
from scheduler_service.core.errors import ErrorKind, RequestError
from scheduler_service.core.step_plan import (
    ContinuingRequestPlan,
    HeldState,
    ImportDone,
    KvImport,
    NewRequestPlan,
    StateCheckpoint,
    StepOutput,
    StepPlan,
)

TokenFn = Callable[[str, Sequence[int]], int]
# Says why a plan's forward fails, or None when it runs, given the plan and the ids of the
# requests it computes for: a fault model for tests and replays.
FailFn = Callable[[StepPlan, list[str]], str | None]


def default_next_token(request_id: str, token_ids: Sequence[int]) -> int:
    """Depends only on the sequence, so recomputing after preemption yields the same tokens."""
    return (sum(token_ids[-4:]) * 31 + len(token_ids)) % 1000 + 3


class PlanMismatch(AssertionError):
    """The plan contradicts what the executor holds: a scheduler bug."""


def _allowed_token(bitmask: bytes, preferred: int) -> int:
    """The preferred token when the bitmask allows it, else one of those it allows, picked by
    the preferred token (so still a function of the sequence alone)."""
    bits = int.from_bytes(bitmask, "little")
    if bits >> preferred & 1:
        return preferred
    allowed = [token for token in range(bits.bit_length()) if bits >> token & 1]
    if not allowed:
        raise PlanMismatch("a bitmask that allows no token")
    return allowed[preferred % len(allowed)]


@dataclass(slots=True)
class _SimRequest:
    token_ids: list[int]
    block_ids: list[int]
    num_computed: int
    handle: int = 0
    state_slot: int = 0


@dataclass(slots=True)
class SimulatedExecutor:
    num_blocks: int
    block_size: int
    next_token: TokenFn = default_next_token
    # Modelled cost of a step: fixed overhead plus a cost per scheduled token, in seconds.
    step_overhead_s: float = 0.002
    per_token_s: float = 0.0001
    elapsed_s: float = 0.0
    slots: dict[int, int] = field(default_factory=dict)
    requests: dict[str, _SimRequest] = field(default_factory=dict)
    last_step_id: int = 0
    # Check at each step that every slot a request attends over holds that request's token.
    verify_kv: bool = True
    fail_step: FailFn | None = None
    # Requests whose state a failed step dropped: a plan already on its way may still continue
    # them, which the real executor refuses as unknown rather than treating as a scheduler bug.
    dropped_by_failure: set[str] = field(default_factory=set)
    # Decode handle -> request id, for the requests held.
    handles: dict[int, str] = field(default_factory=dict)
    # Recurrent-state slots of the modelled hybrid model, 1..num_state_slots; 0: none.
    num_state_slots: int = 0
    # Slot -> the tokens whose recurrent state the checkpoint there keeps, for the checkpoints
    # earlier plans made whose slot no request has taken since.
    checkpoints: dict[int, list[int]] = field(default_factory=dict)
    # Other simulated executors by address, whose offers imports read.
    peers: dict[str, "SimulatedExecutor"] = field(default_factory=dict)
    # Open offers by transfer id, and imports to complete at the next plan.
    offers: dict[str, list[int]] = field(default_factory=dict)
    imports: list[KvImport] = field(default_factory=list)
    # The host tier's slots: host slot -> token.
    host_slots: dict[int, int] = field(default_factory=dict)
    # A hybrid model's moved states: offer -> the tokens its state follows, and slot -> the
    # tokens the state an import wrote there follows.
    offer_states: dict[str, list[int]] = field(default_factory=dict)
    imported_states: dict[int, list[int]] = field(default_factory=dict)
    # Verifies ContinuingRequestPlan.draft_token_ids (ExecutorInfo.supports_draft_tokens); one
    # that does not refuses an entry with drafts, as the real executor would.
    supports_draft_tokens: bool = True
    # The draft model's token after a request's tokens (ContinuingRequestPlan.num_model_drafts);
    # None: no draft model, and an entry that asks for its drafts is refused.
    draft_token: TokenFn | None = None

    def execute(self, plan: StepPlan) -> StepOutput:
        output = self._run(plan)
        if plan.want_held_requests:
            output.held_requests = {
                request_id: HeldState(tuple(state.block_ids), state.num_computed, state.state_slot)
                for request_id, state in self.requests.items()
            }
        return output

    def _run(self, plan: StepPlan) -> StepOutput:
        if plan.step_id <= self.last_step_id:
            raise PlanMismatch(f"step {plan.step_id} after step {self.last_step_id}")
        self.last_step_id = plan.step_id
        cancelled = set(plan.cancelled_imports)
        done = [self._import(entry) for entry in self.imports if entry.transfer_id not in cancelled]
        self.imports = list(plan.kv_imports)
        for export in plan.kv_exports:
            self.offers[export.transfer_id] = list(export.block_ids)
            if export.state_slot:
                holder = next((s for s in self.requests.values() if s.state_slot == export.state_slot), None)
                if holder is None:
                    raise PlanMismatch(f"offer {export.transfer_id} names state slot {export.state_slot}, which no request holds")
                self.offer_states[export.transfer_id] = holder.token_ids[: holder.num_computed]
        for transfer_id in plan.ended_exports:
            if self.offers.pop(transfer_id, None) is None:
                raise PlanMismatch(f"offer {transfer_id} ended but never made")
            self.offer_states.pop(transfer_id, None)
        for request_id in plan.dropped_request_ids:
            self._forget(request_id)
            self.dropped_by_failure.discard(request_id)
        for device_block, host_block in plan.swap_out:
            self._copy_block(self.slots, device_block, self.host_slots, host_block)
        for host_block, device_block in plan.swap_in:
            self._copy_block(self.host_slots, host_block, self.slots, device_block)
        for copy in plan.block_copies:
            self._copy_block(self.slots, copy.source, self.slots, copy.destination)
        output = StepOutput(step_id=plan.step_id, kv_imports_done=done)
        work: list[tuple[str, int]] = []
        # Request id -> its drafts, the length of its tokens before them, and (with a grammar)
        # the mask of each position it samples.
        drafted: dict[str, tuple[list[int], int, list[bytes]]] = {}
        # The tokens each constrained request may sample this step (as the plan's bitmask).
        masks = {
            entry.request_id: entry.allowed_token_bitmask
            for entry in (*plan.new_requests, *plan.continuing_requests)
            if entry.allowed_token_bitmask
        }
        for new in plan.new_requests:
            self.dropped_by_failure.discard(new.request_id)
            if new.request_id in self.requests:
                raise PlanMismatch(f"{new.request_id} is new but already held")
            if new.handle and new.handle in self.handles:
                raise PlanMismatch(f"{new.request_id}'s handle {new.handle} names {self.handles[new.handle]}")
            self._check_state_slot(new)
            # Its state lives in its slot now, whatever a checkpoint kept there.
            self.checkpoints.pop(new.state_slot, None)
            state = _SimRequest(
                list(new.token_ids), list(new.block_ids), new.num_computed_tokens, new.handle, new.state_slot
            )
            self.requests[new.request_id] = state
            if new.handle:
                self.handles[new.handle] = new.request_id
            work.append((new.request_id, new.num_scheduled_tokens))
        for cont in plan.continuing_requests:
            state = self.requests.get(cont.request_id)
            if state is None and cont.request_id in self.dropped_by_failure:
                output.rejected[cont.request_id] = RequestError(ErrorKind.INVALID, "unknown request")
                continue
            if state is None:
                raise PlanMismatch(f"{cont.request_id} continues but is not held")
            if cont.draft_token_ids and not self.supports_draft_tokens:
                output.rejected[cont.request_id] = RequestError(ErrorKind.INVALID, "draft tokens are not supported")
                continue
            if cont.num_model_drafts and self.draft_token is None:
                output.rejected[cont.request_id] = RequestError(ErrorKind.INVALID, "num_model_drafts without a draft model")
                continue
            state.block_ids.extend(cont.new_block_ids)
            if cont.draft_token_ids or cont.num_model_drafts:
                position_masks = [masks[cont.request_id], *cont.draft_bitmasks] if cont.request_id in masks else []
                self._check_drafts(cont, state, position_masks)
                drafts = list(cont.draft_token_ids) or self._propose(cont.request_id, state.token_ids, cont.num_model_drafts)
                drafted[cont.request_id] = (drafts, len(state.token_ids), position_masks)
                state.token_ids.extend(drafts)
            work.append((cont.request_id, cont.num_scheduled_tokens))
        for handle, block_id in zip(plan.decode_block_handles, plan.decode_block_ids, strict=True):
            if handle in self.handles:
                self.requests[self.handles[handle]].block_ids.append(block_id)
        decodes: list[str | None] = []
        for handle in plan.decode_handles:
            request_id = self.handles.get(handle)
            if request_id is None:
                decodes.append(None)
                continue
            state = self.requests[request_id]
            if state.num_computed != len(state.token_ids) - 1:
                raise PlanMismatch(f"{request_id} decodes by handle but is not in steady decode")
            decodes.append(request_id)
            work.append((request_id, 1))
        checkpoints = self._check_checkpoints(plan.state_checkpoints, dict(work))
        for checkpoint in plan.state_checkpoints:
            # Written during the forward: what the slot kept is gone, made or not.
            self.checkpoints.pop(checkpoint.slot, None)
        failure = (
            self.fail_step(plan, [request_id for request_id, _ in work])
            if self.fail_step is not None
            else None
        )
        if failure is not None:
            # As the real executor does: the step's requests lose their state, the rest keep it.
            for request_id, _ in work:
                self._forget(request_id)
                self.dropped_by_failure.add(request_id)
            output.failure = failure
            return output
        # Like each attention layer: the whole step's K/V is written before anyone attends, so
        # a request may read blocks that another request of the same step fills.
        for request_id, num_tokens in work:
            state = self.requests[request_id]
            end = state.num_computed + num_tokens
            if end > len(state.token_ids):
                raise PlanMismatch(f"{request_id} computes to {end} but knows {len(state.token_ids)} tokens")
            if end > len(state.block_ids) * self.block_size:
                raise PlanMismatch(f"{request_id} computes to {end} with {len(state.block_ids)} blocks")
            for position in range(state.num_computed, end):
                self.slots[self._slot(state, position)] = state.token_ids[position]
            state.num_computed = end
        for checkpoint in checkpoints:
            self.checkpoints[checkpoint.slot] = self.requests[checkpoint.request_id].token_ids[: checkpoint.num_tokens]
        for request_id, _ in work:
            state = self.requests[request_id]
            if self.verify_kv:
                self._check_cached(request_id, state)
            if request_id in drafted:
                output.sampled[request_id] = self._verify(request_id, state, *drafted[request_id])
            elif state.num_computed == len(state.token_ids):
                token = self.next_token(request_id, state.token_ids)
                if request_id in masks:
                    token = _allowed_token(masks[request_id], token)
                state.token_ids.append(token)
                output.sampled[request_id] = [token]
        # Decodes by handle are answered in their own list, in plan order.
        output.decode_token_ids = [
            output.sampled.pop(request_id)[0] if request_id is not None else UNHELD_DECODE_TOKEN
            for request_id in decodes
        ]
        output.forward_time_s = self.step_overhead_s + self.per_token_s * plan.num_scheduled_tokens
        self.elapsed_s += output.forward_time_s
        return output

    def _check_drafts(self, cont: ContinuingRequestPlan, state: _SimRequest, masks: list[bytes]) -> None:
        """Drafts come only for a request past its prompt whose earlier steps have all
        answered, after its last token, never with a bitmask to follow; with a grammar, they
        are the scheduler's, each allowed by the mask before it, and one mask follows each."""
        if state.num_computed != len(state.token_ids) - 1:
            raise PlanMismatch(
                f"{cont.request_id} has drafts with {len(state.token_ids) - state.num_computed} tokens to compute"
            )
        if cont.draft_token_ids and cont.num_model_drafts:
            raise PlanMismatch(f"{cont.request_id} has both draft_token_ids and num_model_drafts")
        count = len(cont.draft_token_ids) or cont.num_model_drafts
        if cont.num_scheduled_tokens != 1 + count:
            raise PlanMismatch(f"{cont.request_id} computes {cont.num_scheduled_tokens} tokens with {count} drafts")
        if cont.bitmask_follows:
            raise PlanMismatch(f"{cont.request_id} has drafts and a bitmask to follow")
        if masks and (cont.num_model_drafts or len(masks) != 1 + len(cont.draft_token_ids)):
            raise PlanMismatch(f"{cont.request_id} has {len(masks)} masks for {count} drafts")
        for draft, mask in zip(cont.draft_token_ids, masks):
            if _allowed_token(mask, draft) != draft:
                raise PlanMismatch(f"{cont.request_id}'s draft {draft} is not allowed by its grammar")
        if cont.draft_bitmasks and not masks:
            raise PlanMismatch(f"{cont.request_id} has draft_bitmasks without allowed_token_bitmask")

    def _propose(self, request_id: str, token_ids: Sequence[int], count: int) -> list[int]:
        assert self.draft_token is not None
        drafts: list[int] = []
        for _ in range(count):
            drafts.append(self.draft_token(request_id, [*token_ids, *drafts]))
        return drafts

    def _verify(self, request_id: str, state: _SimRequest, drafts: list[int], known: int, masks: list[bytes]) -> list[int]:
        """The model's token at each computed position (within its mask, with a grammar),
        compared with the draft after it: the accepted drafts and the token after them. Its
        tokens end with them; its computed ones after its last accepted draft, and its block
        table after the blocks that hold those."""
        answer = []
        for index, draft in enumerate([*drafts, None]):
            token = self.next_token(request_id, state.token_ids[: known + index])
            if masks:
                token = _allowed_token(masks[index], token)
            answer.append(token)
            if token != draft:
                break
        del state.token_ids[known + len(answer) - 1 :]
        state.token_ids.append(answer[-1])
        state.num_computed = known + len(answer) - 1
        del state.block_ids[-(-state.num_computed // self.block_size) :]
        return answer

    def _copy_block(self, source: dict[int, int], source_block: int, target: dict[int, int], target_block: int) -> None:
        for offset in range(self.block_size):
            token = source.get(source_block * self.block_size + offset)
            if token is None:
                target.pop(target_block * self.block_size + offset, None)
            else:
                target[target_block * self.block_size + offset] = token

    def _import(self, entry: KvImport) -> ImportDone:
        """Copies an offer's slots from its peer into the import's blocks."""
        peer = self.peers.get(entry.source_address)
        offered = peer.offers.get(entry.transfer_id) if peer is not None else None
        if peer is None or offered is None:
            return ImportDone(entry.transfer_id, False, f"no offer {entry.transfer_id} at {entry.source_address}")
        sources = offered[entry.first_block :]
        if len(sources) != len(entry.block_ids):
            raise PlanMismatch(f"import of {len(entry.block_ids)} blocks from an offer of {len(sources)}")
        for source, destination in zip(sources, entry.block_ids, strict=True):
            self._copy_block(peer.slots, source, self.slots, destination)
        if entry.state_slot:
            state = peer.offer_states.get(entry.transfer_id)
            if state is None:
                raise PlanMismatch(f"import {entry.transfer_id} wants a state its offer does not have")
            self.imported_states[entry.state_slot] = state
        return ImportDone(entry.transfer_id, True, num_bytes=len(sources) * self.block_size)

    def _check_state_slot(self, new: NewRequestPlan) -> None:
        """A hybrid model's request needs a slot of its own, and to compute from its first token
        (its state starting empty) or to resume from a checkpoint that an earlier plan made
        after exactly the tokens it skips; any other model's names neither."""
        slot, source = new.state_slot, new.state_source_slot
        if new.state_in_slot:
            state = self.imported_states.pop(slot, None)
            if source or state != new.token_ids[: new.num_computed_tokens]:
                raise PlanMismatch(
                    f"{new.request_id} takes up its state from slot {slot}, which holds the state after {state}"
                )
            return
        if not self.num_state_slots:
            if slot or source:
                raise PlanMismatch(f"{new.request_id} names state slot {slot or source}, but the model keeps no state")
            return
        for named in (slot, source) if source else (slot,):
            if not 1 <= named <= self.num_state_slots:
                raise PlanMismatch(f"{new.request_id} names state slot {named}, outside 1..{self.num_state_slots}")
            holder = next((rid for rid, held in self.requests.items() if held.state_slot == named), None)
            if holder is not None:
                raise PlanMismatch(f"{new.request_id} names state slot {named}, which {holder} holds")
        if not source:
            if new.num_computed_tokens:
                raise PlanMismatch(
                    f"{new.request_id} starts at token {new.num_computed_tokens}, but its recurrent state starts empty"
                )
            return
        if source == slot:
            raise PlanMismatch(f"{new.request_id} resumes from state slot {source}, its own")
        kept = self.checkpoints.get(source)
        if kept is None:
            raise PlanMismatch(f"{new.request_id} resumes from state slot {source}, which no earlier checkpoint filled")
        if kept != new.token_ids[: new.num_computed_tokens]:
            raise PlanMismatch(
                f"{new.request_id} resumes after {new.num_computed_tokens} tokens from state slot {source}, "
                f"which keeps the state after {len(kept)} other tokens"
            )

    def _check_checkpoints(self, checkpoints: list[StateCheckpoint], work: dict[str, int]) -> list[StateCheckpoint]:
        """The checkpoints to make: each in a slot of the model that no request held has, at a
        point its request computes in this step. One for a request whose earlier failed step
        dropped it is not made, as the real executor skips a request it refuses as unknown."""
        held = {state.state_slot for state in self.requests.values() if state.state_slot}
        made: list[StateCheckpoint] = []
        slots: set[int] = set()
        for checkpoint in checkpoints:
            name = f"checkpoint of {checkpoint.request_id} at {checkpoint.num_tokens} in state slot {checkpoint.slot}"
            if not 1 <= checkpoint.slot <= self.num_state_slots:
                raise PlanMismatch(f"{name}: outside 1..{self.num_state_slots}")
            if checkpoint.slot in held:
                raise PlanMismatch(f"{name}: a request holds that slot")
            if checkpoint.slot in slots:
                raise PlanMismatch(f"{name}: another checkpoint of the plan writes that slot")
            slots.add(checkpoint.slot)
            if checkpoint.request_id not in work and checkpoint.request_id in self.dropped_by_failure:
                continue
            if checkpoint.request_id not in work:
                raise PlanMismatch(f"{name}: the request computes nothing in this step")
            start = self.requests[checkpoint.request_id].num_computed
            if not start < checkpoint.num_tokens <= start + work[checkpoint.request_id]:
                raise PlanMismatch(f"{name}: the step computes its tokens {start} to {start + work[checkpoint.request_id]}")
            made.append(checkpoint)
        return made

    def _forget(self, request_id: str) -> None:
        state = self.requests.pop(request_id, None)
        if state is not None and self.handles.get(state.handle) == request_id:
            del self.handles[state.handle]

    def _slot(self, state: _SimRequest, position: int) -> int:
        block_id = state.block_ids[position // self.block_size]
        if not 0 <= block_id < self.num_blocks:
            raise PlanMismatch(f"block {block_id} outside the pool of {self.num_blocks}")
        return block_id * self.block_size + position % self.block_size

    def _check_cached(self, request_id: str, state: _SimRequest) -> None:
        for position in range(state.num_computed):
            stored = self.slots.get(self._slot(state, position))
            if stored != state.token_ids[position]:
                raise PlanMismatch(
                    f"{request_id}: cached slot for position {position} holds {stored}, "
                    f"not {state.token_ids[position]}"
                )
