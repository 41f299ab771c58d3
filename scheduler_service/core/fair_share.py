"""Token-weighted fair queuing across tenants: the books of the fair policy.

Deficit round robin weighted by tokens, in its counter form (as the Virtual Token Counter of
Sheng et al., "Fairness in Serving Large Language Models", OSDI 2024): each tenant's counter is the
tokens it was served (prompt tokens computed plus tokens generated, charged as steps are
planned) divided by its weight, and the queues admit next from the tenant with the smallest
counter. One set of books serves every executor's queue, so a tenant spread over the fleet is
charged for all of it.

A tenant whose queues were empty and that queues a request is lifted to the smallest counter
among the tenants with requests queued (or, with none queued, placed at all): time spent with
nothing waiting banks no credit to flood with later, even while a request of its own runs, and a
newcomer is not behind those already served. A tenant with nothing placed is forgotten (its
counter would be lifted on its return anyway), so the books hold only tenants with work.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Callable, Iterable

from scheduler_service.core.request import Request


class FairShare:
    def __init__(self, weight_of: Callable[[str], float] = lambda tenant: 1.0) -> None:
        self.weight_of = weight_of
        # Tokens served per unit of weight, by tenant with requests placed.
        self.served: Counter[str] = Counter()
        # Requests placed (queued or running, on any executor), and those queued, by tenant.
        self._placed: Counter[str] = Counter()
        self._queued: Counter[str] = Counter()
        self._members: dict[Request, str] = {}
        self._in_queue: dict[Request, str] = {}

    def counter(self, tenant: str) -> float:
        return self.served[tenant]

    def join(self, request: Request) -> None:
        """The request is placed; a no-op when it already is."""
        if request not in self._members:
            self._members[request] = request.tenant
            self._placed[request.tenant] += 1

    def leave(self, request: Request) -> None:
        """The request is over; a no-op when it was not placed."""
        self.unqueued(request)
        tenant = self._members.pop(request, None)
        if tenant is not None:
            self._placed[tenant] -= 1
            if not self._placed[tenant]:
                del self._placed[tenant]
                self.served.pop(tenant, None)

    def queued(self, request: Request) -> None:
        """The request waits in a queue; a no-op when it already does."""
        if request in self._in_queue:
            return
        tenant = request.tenant
        if not self._queued[tenant]:
            floor = self._floor(tenant)
            if floor is not None and floor > self.served[tenant]:
                self.served[tenant] = floor
        self._in_queue[request] = tenant
        self._queued[tenant] += 1

    def unqueued(self, request: Request) -> None:
        """The request left its queue (admitted, moved, ended); a no-op when it was in none."""
        tenant = self._in_queue.pop(request, None)
        if tenant is not None:
            self._queued[tenant] -= 1
            if not self._queued[tenant]:
                del self._queued[tenant]

    def charge(self, tenant: str, tokens: int) -> None:
        self.served[tenant] += tokens / self.weight_of(tenant)

    def charge_all(self, requests: Iterable[Request]) -> None:
        """One token for each request (a step's steady decodes)."""
        for tenant, count in Counter(r.tenant for r in requests).items():
            self.charge(tenant, count)

    def placed(self, tenant: str) -> int:
        return self._placed[tenant]

    def _floor(self, tenant: str) -> float | None:
        """The smallest counter among the other tenants with requests queued, else placed."""
        for active in (self._queued, self._placed):
            others = [self.served[t] for t in active if t != tenant]
            if others:
                return min(others)
        return None
