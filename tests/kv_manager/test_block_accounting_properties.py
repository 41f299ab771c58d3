"""Random interleavings of admit / compute / decode / verify drafts / fork / finish / preempt on
the KV cache manager.

A shadow model writes each computed token into the slot the manager's block table names (and
copies blocks as a fork's BlockCopy says), so a prefix-cache hit or a fork is checked against
what was really stored there, not only against hashes, and every request must read its own
tokens back from its table: nobody writes into a block another request still reads.
"""

from collections import Counter
from dataclasses import dataclass, field

from hypothesis import HealthCheck, settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, invariant, precondition, rule

from kv_manager import KVCacheManager, PoolExhausted
from kv_manager.prefix_hash import pack_tokens

BLOCK_SIZE = 4
NUM_BLOCKS = 12
# A few shared stems make prefix hits common; a tiny vocabulary makes them collide in content.
STEMS = [[1, 2, 3, 4, 5, 6, 7, 8], [1, 2, 3, 4, 9, 9, 9, 9], [5, 5, 5, 5]]


@dataclass
class ShadowRequest:
    tokens: list[int]
    salt: bytes
    computed: int = 0
    # Tokens whose result came back (cache_computed): what a fork may share.
    committed: int = 0
    admitted: bool = False
    preemptions: int = 0
    slots: list[int] = field(default_factory=list)


class KVManagerMachine(RuleBasedStateMachine):
    def __init__(self) -> None:
        super().__init__()
        self.kv = KVCacheManager(NUM_BLOCKS, BLOCK_SIZE)
        self.requests: dict[str, ShadowRequest] = {}
        self.content: dict[int, int] = {}
        self.next_id = 0

    def _write(self, request_id: str, req: ShadowRequest, start: int, end: int) -> None:
        table = self.kv.block_ids(request_id)
        for pos in range(start, end):
            slot = table[pos // BLOCK_SIZE] * BLOCK_SIZE + pos % BLOCK_SIZE
            self.content[slot] = req.tokens[pos]

    @rule(
        stem=st.sampled_from(STEMS),
        tail=st.lists(st.integers(0, 3), max_size=9),
        salted=st.booleans(),
    )
    def arrive(self, stem: list[int], tail: list[int], salted: bool) -> None:
        self.requests[f"r{self.next_id}"] = ShadowRequest(stem + tail, b"tenant" if salted else b"")
        self.next_id += 1

    @precondition(lambda self: any(not r.admitted for r in self.requests.values()))
    @rule(data=st.data(), chunk=st.integers(1, 16), commit=st.booleans())
    def admit(self, data: st.DataObject, chunk: int, commit: bool) -> None:
        waiting = sorted(k for k, r in self.requests.items() if not r.admitted)
        request_id = data.draw(st.sampled_from(waiting))
        req = self.requests[request_id]
        hit = self.kv.find_cached_prefix(req.tokens, req.salt)
        assert hit.num_tokens < len(req.tokens)
        for i, block in enumerate(hit.blocks):
            stored = [self.content.get(block.block_id * BLOCK_SIZE + j) for j in range(BLOCK_SIZE)]
            assert stored == req.tokens[i * BLOCK_SIZE : (i + 1) * BLOCK_SIZE], "hit on wrong content"
        num_new = min(chunk, len(req.tokens) - hit.num_tokens)
        free_before = self.kv.num_free_blocks
        new_ids = self.kv.allocate_slots(
            request_id, req.tokens, hit.num_tokens, num_new, hit, extra_key=req.salt
        )
        if new_ids is None:
            assert self.kv.num_free_blocks == free_before and not self.kv.holds(request_id)
            return
        req.admitted, req.computed = True, hit.num_tokens
        self._write(request_id, req, req.computed, req.computed + num_new)
        req.computed += num_new
        if commit:
            self.kv.cache_computed(request_id, req.tokens, req.computed)
            req.committed = req.computed

    @precondition(lambda self: any(r.admitted and r.committed for r in self.requests.values()))
    @rule(data=st.data())
    def fork(self, data: st.DataObject) -> None:
        """A sibling choice takes the K/V of a request's first tokens once they are written."""
        parents = sorted(k for k, r in self.requests.items() if r.admitted and r.committed)
        parent_id = data.draw(st.sampled_from(parents))
        parent = self.requests[parent_id]
        num_tokens = data.draw(st.integers(1, parent.committed))
        child_id = f"r{self.next_id}"
        self.next_id += 1
        free_before = self.kv.num_free_blocks
        try:
            copy = self.kv.fork(parent_id, child_id, num_tokens)
        except PoolExhausted:
            assert num_tokens % BLOCK_SIZE and free_before == 0 and not self.kv.holds(child_id)
            return
        if copy is not None:
            for j in range(BLOCK_SIZE):
                source = self.content.get(copy.source * BLOCK_SIZE + j)
                if source is not None:
                    self.content[copy.destination * BLOCK_SIZE + j] = source
        # Siblings share what was forked and differ from there on (each samples its own).
        tail = data.draw(st.lists(st.integers(0, 3), min_size=1, max_size=4))
        child = ShadowRequest(parent.tokens[:num_tokens] + tail, parent.salt, num_tokens, num_tokens, admitted=True)
        self.requests[child_id] = child
        assert self.kv.num_written(child_id) == num_tokens

    @precondition(lambda self: any(r.admitted for r in self.requests.values()))
    @rule(data=st.data(), chunk=st.integers(1, 8), decoded=st.integers(0, 3), commit=st.booleans(), packed=st.booleans())
    def step(self, data: st.DataObject, chunk: int, decoded: int, commit: bool, packed: bool) -> None:
        running = sorted(k for k, r in self.requests.items() if r.admitted)
        request_id = data.draw(st.sampled_from(running))
        req = self.requests[request_id]
        if req.computed == len(req.tokens):
            req.tokens.append(decoded)
        num_new = min(chunk, len(req.tokens) - req.computed)
        if self.kv.allocate_slots(request_id, req.tokens, req.computed, num_new) is None:
            return
        self._write(request_id, req, req.computed, req.computed + num_new)
        req.computed += num_new
        # Results come back late, or (pipelined) after the next step was planned.
        if commit:
            if packed and req.computed % BLOCK_SIZE == 0:
                # As a steady decode's completed block is entered (DecodeSet), with the
                # general path for a request whose earlier blocks are not all entered yet.
                block = pack_tokens(req.tokens[req.computed - BLOCK_SIZE : req.computed])
                if self.kv.cache_next_blocks([request_id], [req.computed], [block]):
                    self.kv.cache_computed(request_id, req.tokens, req.computed)
            else:
                self.kv.cache_computed(request_id, req.tokens, req.computed)
            req.committed = req.computed

    @precondition(lambda self: any(r.admitted and r.computed == len(r.tokens) for r in self.requests.values()))
    @rule(
        data=st.data(),
        drafts=st.lists(st.integers(0, 3), min_size=1, max_size=4),
        accepted=st.integers(0, 4),
        commit=st.booleans(),
    )
    def verify(self, data: st.DataObject, drafts: list[int], accepted: int, commit: bool) -> None:
        """A decode with drafts: its last token and the drafts computed, some accepted; the
        blocks past the computed tokens (rejected drafts only) are given back."""
        ready = sorted(k for k, r in self.requests.items() if r.admitted and r.computed == len(r.tokens))
        request_id = data.draw(st.sampled_from(ready))
        req = self.requests[request_id]
        last = data.draw(st.integers(0, 3))
        chunk = [last, *drafts]
        if self.kv.allocate_slots(request_id, [*req.tokens, *chunk], req.computed, len(chunk)) is None:
            return
        written = ShadowRequest([*req.tokens, *chunk], req.salt, req.computed)
        self._write(request_id, written, req.computed, req.computed + len(chunk))
        accepted = min(accepted, len(drafts))
        req.tokens += chunk[: 1 + accepted]
        req.computed = len(req.tokens)
        self.kv.keep_tokens(request_id, req.computed)
        if commit:
            self.kv.cache_computed(request_id, req.tokens, req.computed)
            req.committed = req.computed

    @precondition(lambda self: any(r.admitted for r in self.requests.values()))
    @rule(data=st.data(), preempt=st.booleans())
    def release(self, data: st.DataObject, preempt: bool) -> None:
        running = sorted(k for k, r in self.requests.items() if r.admitted)
        request_id = data.draw(st.sampled_from(running))
        self.kv.free(request_id)
        if preempt:
            req = self.requests[request_id]
            req.admitted, req.computed, req.committed = False, 0, 0
            req.preemptions += 1
        else:
            del self.requests[request_id]

    @rule()
    def free_unknown_is_a_no_op(self) -> None:
        before = self.kv.pool.free_block_ids()
        self.kv.free("never-admitted")
        assert self.kv.pool.free_block_ids() == before

    @invariant()
    def ref_counts_match_holders(self) -> None:
        holders = Counter(
            block_id for rid in self.requests for block_id in self.kv.block_ids(rid)
        )
        for block in self.kv.pool.blocks:
            assert block.ref_count == holders.get(block.block_id, 0), block

    @invariant()
    def free_plus_used_is_total(self) -> None:
        free = self.kv.pool.free_block_ids()
        assert len(free) == len(set(free)), "a block is in the free queue twice"
        used = {b.block_id for b in self.kv.pool.blocks if b.ref_count > 0}
        assert used.isdisjoint(free)
        assert len(free) + len(used) == NUM_BLOCKS

    @invariant()
    def cache_index_matches_blocks(self) -> None:
        for block_hash, block_id in self.kv.pool.cached_hashes().items():
            assert self.kv.pool.blocks[block_id].block_hash == block_hash

    @invariant()
    def every_request_reads_its_own_tokens(self) -> None:
        for request_id, req in self.requests.items():
            if not req.admitted:
                continue
            table = self.kv.block_ids(request_id)
            stored = [self.content.get(table[pos // BLOCK_SIZE] * BLOCK_SIZE + pos % BLOCK_SIZE) for pos in range(req.computed)]
            assert stored == req.tokens[: req.computed], request_id

    @invariant()
    def tables_cover_computed_tokens(self) -> None:
        for request_id, req in self.requests.items():
            if req.admitted:
                assert len(self.kv.block_ids(request_id)) == -(-req.computed // BLOCK_SIZE)
            else:
                assert not self.kv.holds(request_id)


KVManagerMachine.TestCase.settings = settings(
    max_examples=1000,
    stateful_step_count=40,
    deadline=None,
    suppress_health_check=[HealthCheck.too_slow],
)
TestKVManagerProperties = KVManagerMachine.TestCase
