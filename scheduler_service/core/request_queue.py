"""The waiting queue, ordered by the scheduling policy."""

import heapq
from collections import deque
from collections.abc import Iterator

from scheduler_service.core.policy import Policy, rank
from scheduler_service.core.request import Request


class WaitingQueue:
    """FCFS is a deque; priority is a heap on (priority, arrival). A preempted request goes back
    to the head: under FCFS explicitly, under priority through its unchanged rank."""

    def __init__(self, policy: Policy) -> None:
        self.policy = policy
        self._fifo: deque[Request] = deque()
        self._heap: list[tuple[tuple[int, int], Request]] = []

    def __len__(self) -> int:
        return len(self._fifo) + len(self._heap)

    def __iter__(self) -> Iterator[Request]:
        """Requests in the order they would be admitted."""
        if self.policy is Policy.FCFS:
            return iter(list(self._fifo))
        return iter([r for _, r in sorted(self._heap, key=lambda item: item[0])])

    def add(self, request: Request) -> None:
        if self.policy is Policy.FCFS:
            self._fifo.append(request)
        else:
            heapq.heappush(self._heap, (rank(request, self.policy), request))

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

    def push_front(self, request: Request) -> None:
        if self.policy is Policy.FCFS:
            self._fifo.appendleft(request)
        else:
            self.add(request)

    def peek(self) -> Request:
        return self._fifo[0] if self.policy is Policy.FCFS else self._heap[0][1]

    def pop(self) -> Request:
        if self.policy is Policy.FCFS:
            return self._fifo.popleft()
        return heapq.heappop(self._heap)[1]

    def remove(self, request: Request) -> bool:
        if self.policy is Policy.FCFS:
            if request in self._fifo:
                self._fifo.remove(request)
                return True
            return False
        for index, (_, queued) in enumerate(self._heap):
            if queued is request:
                self._heap[index] = self._heap[-1]
                self._heap.pop()
                heapq.heapify(self._heap)
                return True
        return False

    def reordered(self, policy: Policy) -> "WaitingQueue":
        """The same requests queued under another policy (a live policy change): under FCFS in
        arrival order, under priority by rank."""
        queue = WaitingQueue(policy)
        for request in sorted(self, key=lambda r: r.arrival_index):
            queue.add(request)
        return queue
