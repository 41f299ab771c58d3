"""Random interleavings of admit / compute / swap out / swap in / finish on a KV cache manager with
a host tier, each operation one plan.

A shadow executor runs each plan as the real one does: the tier's swap-outs, then its swap-ins
(take_tier_copies), then the step's writes into the slots the block tables name. Every request
holding blocks must read its own computed tokens back from them, so a swap-in from the wrong
host block, a cached prefix block stored or restored wrong, or a block written while another
request still reads it, fails here; and the books (kv_manager/audit.py) agree with themselves.
"""

from dataclasses import dataclass

from hypothesis import HealthCheck, settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, invariant, precondition, rule

from kv_manager import KVCacheManager
from kv_manager.audit import pool_mismatches

BLOCK_SIZE = 4
NUM_BLOCKS = 10
NUM_HOST_BLOCKS = 6
STEMS = [[1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12], [1, 2, 3, 4, 9, 9, 9, 9], [5, 5, 5, 5, 6, 6, 6, 6]]


@dataclass
class ShadowRequest:
    tokens: list[int]
    computed: int = 0
    state: str = "waiting"  # waiting, running, swapped


class HostTierMachine(RuleBasedStateMachine):
    def __init__(self) -> None:
        super().__init__()
        self.kv = KVCacheManager(NUM_BLOCKS, BLOCK_SIZE, num_host_blocks=NUM_HOST_BLOCKS)
        self.requests: dict[str, ShadowRequest] = {}
        self.device: dict[int, int] = {}
        self.host: dict[int, int] = {}
        self.next_id = 0

    def _run_plan(self, writes: list[tuple[str, int, int]]) -> None:
        copies = self.kv.take_tier_copies()
        for device_block, host_block in copies.swap_out:
            self._copy(self.device, device_block, self.host, host_block)
        for host_block, device_block in copies.swap_in:
            self._copy(self.host, host_block, self.device, device_block)
        for request_id, start, end in writes:
            req, table = self.requests[request_id], self.kv.block_ids(request_id)
            for pos in range(start, end):
                self.device[table[pos // BLOCK_SIZE] * BLOCK_SIZE + pos % BLOCK_SIZE] = req.tokens[pos]

    @staticmethod
    def _copy(source: dict[int, int], source_block: int, target: dict[int, int], target_block: int) -> None:
        for j in range(BLOCK_SIZE):
            token = source.get(source_block * BLOCK_SIZE + j)
            if token is None:
                target.pop(target_block * BLOCK_SIZE + j, None)
            else:
                target[target_block * BLOCK_SIZE + j] = token

    def _ids(self, state: str) -> list[str]:
        return sorted(k for k, r in self.requests.items() if r.state == state)

    @rule(stem=st.sampled_from(STEMS), tail=st.lists(st.integers(0, 3), max_size=6))
    def arrive(self, stem: list[int], tail: list[int]) -> None:
        self.requests[f"r{self.next_id}"] = ShadowRequest(stem + tail)
        self.next_id += 1

    @precondition(lambda self: self._ids("waiting"))
    @rule(data=st.data(), chunk=st.integers(1, 16))
    def admit(self, data: st.DataObject, chunk: int) -> None:
        request_id = data.draw(st.sampled_from(self._ids("waiting")))
        req = self.requests[request_id]
        hit = self.kv.find_cached_prefix(req.tokens)
        num_new = min(chunk, len(req.tokens) - hit.num_tokens)
        if self.kv.allocate_slots(request_id, req.tokens, hit.num_tokens, num_new, hit) is None:
            self._run_plan([])
            return
        req.state, req.computed = "running", hit.num_tokens + num_new
        self._run_plan([(request_id, hit.num_tokens, req.computed)])
        self.kv.cache_computed(request_id, req.tokens, req.computed)

    @precondition(lambda self: self._ids("running"))
    @rule(data=st.data(), chunk=st.integers(1, 8), decoded=st.integers(0, 3))
    def step(self, data: st.DataObject, chunk: int, decoded: int) -> None:
        request_id = data.draw(st.sampled_from(self._ids("running")))
        req = self.requests[request_id]
        if req.computed == len(req.tokens):
            req.tokens.append(decoded)
        num_new = min(chunk, len(req.tokens) - req.computed)
        if self.kv.allocate_slots(request_id, req.tokens, req.computed, num_new) is None:
            self._run_plan([])
            return
        start, req.computed = req.computed, req.computed + num_new
        self._run_plan([(request_id, start, req.computed)])
        self.kv.cache_computed(request_id, req.tokens, req.computed)

    @precondition(lambda self: self._ids("running"))
    @rule(data=st.data())
    def swap_out(self, data: st.DataObject) -> None:
        request_id = data.draw(st.sampled_from(self._ids("running")))
        req = self.requests[request_id]
        if self.kv.swap_out(request_id, req.computed):
            req.state = "swapped"
        self._run_plan([])

    @precondition(lambda self: self._ids("swapped"))
    @rule(data=st.data())
    def swap_in(self, data: st.DataObject) -> None:
        request_id = data.draw(st.sampled_from(self._ids("swapped")))
        if self.kv.swap_in(request_id, num_tokens=self.requests[request_id].computed):
            self.requests[request_id].state = "running"
        self._run_plan([])

    @precondition(lambda self: self._ids("swapped") and self._ids("running"))
    @rule(data=st.data(), out_first=st.booleans())
    def swap_in_and_out_in_one_plan(self, data: st.DataObject, out_first: bool) -> None:
        """One plan brings a request back and sends another out: neither may be given blocks
        (host or device) that the other's copy still reads."""
        back = data.draw(st.sampled_from(self._ids("swapped")))
        out = data.draw(st.sampled_from(self._ids("running")))
        for which in (out, back) if out_first else (back, out):
            if which == back and self.kv.swap_in(back, num_tokens=self.requests[back].computed):
                self.requests[back].state = "running"
            elif which == out and self.kv.swap_out(out, self.requests[out].computed):
                self.requests[out].state = "swapped"
        self._run_plan([])

    @precondition(lambda self: self._ids("running") or self._ids("swapped"))
    @rule(data=st.data())
    def finish(self, data: st.DataObject) -> None:
        request_id = data.draw(st.sampled_from(self._ids("running") + self._ids("swapped")))
        self.kv.free(request_id)
        del self.requests[request_id]
        self._run_plan([])

    @invariant()
    def every_request_reads_its_own_tokens(self) -> None:
        for request_id, req in self.requests.items():
            if req.state != "running":
                continue
            table = self.kv.block_ids(request_id)
            stored = [self.device.get(table[p // BLOCK_SIZE] * BLOCK_SIZE + p % BLOCK_SIZE) for p in range(req.computed)]
            assert stored == req.tokens[: req.computed], request_id

    @invariant()
    def books_agree(self) -> None:
        assert pool_mismatches(self.kv) == []
        swapped = {rid for rid, req in self.requests.items() if req.state == "swapped"}
        assert set(self.kv.host.swapped_tables()) == swapped if self.kv.host else True


HostTierMachine.TestCase.settings = settings(
    max_examples=150, stateful_step_count=40, deadline=None, suppress_health_check=[HealthCheck.too_slow]
)
TestHostTier = HostTierMachine.TestCase
