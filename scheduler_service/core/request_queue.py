"""The waiting queue, ordered by the scheduling policy."""

from __future__ import annotations

import heapq
from collections import deque
from collections.abc import Iterator

from scheduler_service.core.fair_share import FairShare
from scheduler_service.core.policy import Policy, rank
from scheduler_service.core.request import Request

_Heap = list[tuple[tuple[int, float, int], Request]]


class WaitingQueue:
    """FCFS is a deque; priority is a heap on rank (priority, deadline, arrival); fair is one
    such heap per tenant, the head taken from the tenant with the smallest fair-share counter.
    A preempted request goes back to the head: under FCFS explicitly, otherwise through its
    unchanged rank."""

    def __init__(self, policy: Policy, share: FairShare | None = None) -> None:
        self.policy = policy
        # The fair policy's counters (a queue of its own when none is shared).
        self.share = share if share is not None else FairShare()
        self._fifo: deque[Request] = deque()
        self._heap: _Heap = []
        self._tenants: dict[str, _Heap] = {}
        self._size = 0

    def __len__(self) -> int:
        return self._size

    def __iter__(self) -> Iterator[Request]:
        """Requests in the order they would be admitted were the counters to stay as they
        are (under fair: each tenant's requests in rank order, tenants by counter)."""
        if self.policy is Policy.FCFS:
            return iter(list(self._fifo))
        if self.policy is Policy.PRIORITY:
            return iter([r for _, r in sorted(self._heap, key=lambda item: item[0])])
        ordered = []
        for tenant in sorted(self._tenants, key=self._tenant_key):
            ordered += [r for _, r in sorted(self._tenants[tenant], key=lambda item: item[0])]
        return iter(ordered)

    def add(self, request: Request) -> None:
        self._size += 1
        if self.policy is Policy.FCFS:
            self._fifo.append(request)
            return
        if self.policy is Policy.FAIR:
            self.share.queued(request)
        heapq.heappush(self._heap_of(request.tenant), (rank(request, self.policy), request))

    def insert(self, request: Request) -> None:
        """Queues a request that arrived earlier elsewhere (another executor's queue) in its
        arrival order."""
        if self.policy is not Policy.FCFS:
            self.add(request)
            return
        position = len(self._fifo)
        while position > 0 and self._fifo[position - 1].arrival_index > request.arrival_index:
            position -= 1
        self._fifo.insert(position, request)
        self._size += 1

    def push_front(self, request: Request) -> None:
        if self.policy is Policy.FCFS:
            self._fifo.appendleft(request)
            self._size += 1
        else:
            self.add(request)

    def peek(self) -> Request:
        if self.policy is Policy.FCFS:
            return self._fifo[0]
        return self._head_heap()[0][1]

    def pop(self) -> Request:
        if self.policy is Policy.FCFS:
            request = self._fifo.popleft()
        else:
            heap = self._head_heap()
            request = heapq.heappop(heap)[1]
            if self.policy is Policy.FAIR:
                self.share.unqueued(request)
                if not heap:
                    del self._tenants[request.tenant]
        self._size -= 1
        return request

    def remove(self, request: Request) -> bool:
        if self.policy is Policy.FCFS:
            if request in self._fifo:
                self._fifo.remove(request)
                self._size -= 1
                return True
            return False
        heap = self._heap if self.policy is Policy.PRIORITY else self._tenants.get(request.tenant, [])
        for index, (_, queued) in enumerate(heap):
            if queued is request:
                heap[index] = heap[-1]
                heap.pop()
                heapq.heapify(heap)
                if self.policy is Policy.FAIR:
                    self.share.unqueued(request)
                    if not heap:
                        del self._tenants[request.tenant]
                self._size -= 1
                return True
        return False

    def reordered(self, policy: Policy) -> WaitingQueue:
        """The same requests queued under another policy (a live policy change): under FCFS in
        arrival order, otherwise by rank."""
        queue = WaitingQueue(policy, self.share)
        for request in sorted(self, key=lambda r: r.arrival_index):
            if self.policy is Policy.FAIR:
                # Counted afresh by the new queue, if it is fair too.
                self.share.unqueued(request)
            queue.add(request)
        return queue

    def clear(self) -> None:
        """Empties the queue (its executor is gone)."""
        for request in self:
            self.share.unqueued(request)
        self._fifo.clear()
        self._heap.clear()
        self._tenants.clear()
        self._size = 0

    def _heap_of(self, tenant: str) -> _Heap:
        if self.policy is Policy.PRIORITY:
            return self._heap
        heap = self._tenants.get(tenant)
        if heap is None:
            heap = self._tenants[tenant] = []
        return heap

    def _head_heap(self) -> _Heap:
        if self.policy is Policy.PRIORITY:
            return self._heap
        if not self._tenants:
            raise IndexError("the waiting queue is empty")
        return self._tenants[min(self._tenants, key=self._tenant_key)]

    def _tenant_key(self, tenant: str) -> tuple[float, int]:
        """The tenant served least per weight first; a tie goes to the earlier head."""
        return (self.share.counter(tenant), self._tenants[tenant][0][0][2])
