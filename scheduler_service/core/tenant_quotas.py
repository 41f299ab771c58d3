"""Each tenant's quotas (core/tenants.py), enforced at arrival: most requests placed on
executors (more wait here, in the tenant's own queue, for one of its requests to end), most
waiting here, and tokens asked for per minute. Past them a request is refused with
RESOURCE_EXHAUSTED and a retry-after hint; other tenants never notice."""

from __future__ import annotations

import math
import time
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, field

from scheduler_service.core.errors import AdmissionRefused, ErrorKind
from scheduler_service.core.policy import Policy, rank
from scheduler_service.core.request import Request
from scheduler_service.core.tenants import TenantLimits, TenantTable

WINDOW_S = 60.0
# Books kept for tenants with nothing in flight before they are swept (tenants named by
# x-splitserve-tenant are not bounded by the tenants file).
_IDLE_BOOKS = 1000
# Seconds a request holds its seat, assumed until one of the tenant's requests ended.
_DEFAULT_HOLD_S = 1.0
_HOLD_SMOOTHING = 0.1


@dataclass(slots=True)
class TenantBooks:
    # Requests placed on executors, with when each was placed.
    placed: dict[Request, float] = field(default_factory=dict)
    # Requests waiting for a seat under max_running, in arrival order.
    held: list[Request] = field(default_factory=list)
    # [when, tokens] asked in the last WINDOW_S, and their sum; by request too while it is in
    # flight (one that ends without having run gives its tokens back).
    asked: deque[list[float]] = field(default_factory=deque)
    asked_tokens: int = 0
    entries: dict[Request, list[float]] = field(default_factory=dict)
    # Mean seconds a request held its seat.
    hold_s: float = _DEFAULT_HOLD_S

    def expire(self, now: float) -> None:
        while self.asked and self.asked[0][0] <= now - WINDOW_S:
            self.asked_tokens -= int(self.asked.popleft()[1])

    @property
    def idle(self) -> bool:
        return not (self.placed or self.held or self.asked)


def asked_tokens(request: Request, max_model_len: int | None) -> int:
    """What a request may use of its tenant's tokens_per_minute: its prompt and its most output
    (the model's length when it sets no max_tokens; unknown before an executor was reached)."""
    most = request.sampling.max_tokens
    if most is None:
        most = max(0, max_model_len - request.num_prompt_tokens) if max_model_len is not None else 0
    return request.num_prompt_tokens + most


class TenantQuotas:
    def __init__(self, table: TenantTable, clock: Callable[[], float] = time.monotonic) -> None:
        self.table = table
        self.clock = clock
        self.books: dict[str, TenantBooks] = {}

    def admit(self, request: Request, max_model_len: int | None = None, may_refuse: bool = True) -> bool:
        """True: place it now; False: it waits here for a seat (held). It asks for its
        asked_tokens. AdmissionRefused when it is over its tenant's quotas, unless it may not be
        refused (a request the client already streams, submitted again after its planner was
        lost)."""
        tokens = asked_tokens(request, max_model_len)
        now = self.clock()
        if len(self.books) > _IDLE_BOOKS:
            self._sweep(now)
        limits = self.table.limits(request.tenant)
        books = self.books.setdefault(request.tenant, TenantBooks())
        books.expire(now)
        if may_refuse:
            self._check_tokens(request.tenant, limits, books, tokens, now)
        seated = limits.max_running is None or len(books.placed) < limits.max_running
        if may_refuse and not seated and limits.max_waiting is not None and len(books.held) >= limits.max_waiting:
            retry = (len(books.held) + 1) * books.hold_s / (limits.max_running or 1)
            raise AdmissionRefused(
                "max_waiting",
                ErrorKind.OVERLOADED,
                f"tenant {request.tenant!r} has {len(books.placed)} requests running (its max_running) "
                f"and {len(books.held)} waiting (its max_waiting); retry after {retry:.1f} s",
                retry,
            )
        entry = [now, tokens]
        books.asked.append(entry)
        books.asked_tokens += tokens
        books.entries[request] = entry
        if seated:
            books.placed[request] = now
        else:
            books.held.append(request)
        return seated

    def ended(self, request: Request) -> list[Request]:
        """The request is over (finished, failed or aborted): the held requests that take its
        seat, to place now. One that never ran gives back the tokens it asked for (a choice of
        several cancelled with its siblings' refusal must not use up the quota of the retry)."""
        books = self.books.get(request.tenant)
        if books is None:
            return []
        entry = books.entries.pop(request, None)
        if entry is not None and request.first_scheduled_time is None:
            books.asked_tokens -= int(entry[1])
            entry[1] = 0
        placed_at = books.placed.pop(request, None)
        if placed_at is None:
            if request in books.held:
                books.held.remove(request)
            return []
        books.hold_s += _HOLD_SMOOTHING * (self.clock() - placed_at - books.hold_s)
        return self.seat_held(request.tenant)

    def seat_held(self, tenant: str) -> list[Request]:
        """The tenant's held requests that have a seat now (one ended, or the limit was raised),
        in its own order (priority, deadline, arrival), to place."""
        books = self.books.get(tenant)
        if books is None:
            return []
        limits = self.table.limits(tenant)
        now = self.clock()
        seated = []
        while books.held and (limits.max_running is None or len(books.placed) < limits.max_running):
            head = min(books.held, key=lambda r: rank(r, Policy.PRIORITY))
            books.held.remove(head)
            books.placed[head] = now
            seated.append(head)
        return seated

    def seat_wait_s(self, tenant: str) -> float:
        """Predicted seconds until a request of this tenant held now gets a seat."""
        books = self.books.get(tenant)
        limits = self.table.limits(tenant)
        if books is None or limits.max_running is None:
            return 0.0
        return len(books.held) * books.hold_s / limits.max_running

    def held(self) -> list[Request]:
        return [r for books in self.books.values() for r in books.held]

    @property
    def num_held(self) -> int:
        return sum(len(books.held) for books in self.books.values())

    def _sweep(self, now: float) -> None:
        for tenant in list(self.books):
            books = self.books[tenant]
            books.expire(now)
            if books.idle:
                del self.books[tenant]

    def _check_tokens(self, tenant: str, limits: TenantLimits, books: TenantBooks, tokens: int, now: float) -> None:
        quota = limits.tokens_per_minute
        if quota is None or books.asked_tokens + tokens <= quota:
            return
        if tokens > quota:
            raise AdmissionRefused(
                "tokens_per_minute",
                ErrorKind.TOO_LARGE,
                f"the request asks for {tokens} tokens (prompt + max_tokens), more than tenant "
                f"{tenant!r}'s tokens_per_minute of {quota}: lower max_tokens",
            )
        # When enough of the window has expired for this request to fit.
        freed, retry = books.asked_tokens + tokens - quota, WINDOW_S
        for at, asked in books.asked:
            freed -= asked
            if freed <= 0:
                retry = at + WINDOW_S - now
                break
        retry = max(0.1, math.ceil(retry * 10) / 10)
        raise AdmissionRefused(
            "tokens_per_minute",
            ErrorKind.OVERLOADED,
            f"tenant {tenant!r} asked for {books.asked_tokens} tokens in the last minute; this "
            f"request's {tokens} would pass its tokens_per_minute of {quota}; retry after {retry:.1f} s",
            retry,
        )
