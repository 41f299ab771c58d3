"""Token-weighted fair queuing across tenants: the books of the fair policy.

Deficit round robin weighted by tokens, in its counter form (as the Virtual Token Counter of
Sheng et al., "Fairness in Serving Large Language Models", OSDI 2024): each tenant's counter is the
tokens it was served (prompt tokens computed plus tokens generated, charged as steps are
planned) divided by its weight, and the queues admit next from the tenant with the smallest
counter. One set of books serves every executor's queue, so a tenant spread over the fleet is
charged for all of it.

A tenant that had nothing placed and sends a request is lifted to the smallest counter among the
tenants that have requests placed: an idle tenant banks no credit to flood with later, and a new
one is not behind those already served.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Callable, Iterable

from scheduler_service.core.request import Request


class FairShare:
    def __init__(self, weight_of: Callable[[str], float] = lambda tenant: 1.0) -> None:
        self.weight_of = weight_of
        # Tokens served per unit of weight, by tenant, since start.
        self.served: Counter[str] = Counter()
        # Requests placed (queued or running, on any executor), by tenant.
        self._placed: Counter[str] = Counter()
        self._members: dict[Request, str] = {}

    def counter(self, tenant: str) -> float:
        return self.served[tenant]

    def join(self, request: Request) -> None:
        """The request is placed; a no-op when it already is."""
        if request in self._members:
            return
        tenant = request.tenant
        if not self._placed[tenant]:
            floor = min((self.served[t] for t, n in self._placed.items() if n), default=None)
            if floor is not None and floor > self.served[tenant]:
                self.served[tenant] = floor
        self._members[request] = tenant
        self._placed[tenant] += 1

    def leave(self, request: Request) -> None:
        """The request is over; a no-op when it was not placed."""
        tenant = self._members.pop(request, None)
        if tenant is not None:
            self._placed[tenant] -= 1
            if not self._placed[tenant]:
                del self._placed[tenant]

    def charge(self, tenant: str, tokens: int) -> None:
        self.served[tenant] += tokens / self.weight_of(tenant)

    def charge_all(self, requests: Iterable[Request]) -> None:
        """One token for each request (a step's steady decodes)."""
        for tenant, count in Counter(r.tenant for r in requests).items():
            self.charge(tenant, count)

    def placed(self, tenant: str) -> int:
        return self._placed[tenant]
