"""The slots flow: concurrency (core/concurrency.py), all or nothing with the rate limits.

In two atomic steps: the request's slots are acquired first (one atomic store call, all or
none), then the rates are admitted (flows/rates.py), and when the rates reject the slots are
released at once. So a request refused a slot never reaches the rate counters and consumes
no rate capacity, and a request refused by a rate holds no slot once it is answered. The
window between the two steps (one store call) can only make a concurrent request see a slot
taken that is about to come back - a spurious refusal, never an admission past a limit. If
that release fails (backend gone) the slot expires after its rule's max_duration.
"""

import uuid

from fairlimit.core.admission import Code, Status
from fairlimit.core.concurrency import Claim, SlotOutcome, Slots, split, taken
from fairlimit.core.matching import Matcher
from fairlimit.core.request import Request
from fairlimit.core.reserve import Reserve
from fairlimit.flows.decision import Active, Decision
from fairlimit.flows.rates import RatesFlow
from fairlimit.policy.answers import unanswered
from fairlimit.store.base import Store
from fairlimit.telemetry import Telemetry


class SlotsFlow:
    """Decides requests that take or give back slots, and names anonymous slots."""

    def __init__(self, store: Store, telemetry: Telemetry, rates: RatesFlow, shadow: bool) -> None:
        self._store = store  # the failure policy's: its answers are the failure mode's too
        self._telemetry = telemetry
        self._rates = rates
        self._shadow = shadow
        self._origin, self._made = uuid.uuid4().hex[:12], 0  # anonymous slot ids

    def split(self, request: Request, active: Active) -> Slots | None:
        """The slots ``request`` takes and gives back under ``active`` (None when it
        declares no concurrency)."""
        if not active.slots:
            return None
        return split(request, active.matcher, self._anonymous(active))

    def _anonymous(self, active: Active) -> str:
        """A fresh id for the slots of rules released by negative hits ("" without any):
        unique across the processes sharing a store."""
        if not active.anonymous:
            return ""
        self._made += 1
        return f"~{self._origin}-{self._made}"

    async def decide(
        self,
        request: Request,
        slots: Slots,
        now: float,
        matcher: Matcher,
        reserve: tuple[Reserve, ...] = (),
    ) -> Decision:
        """Release, then acquire, then the rates (see the module docstring)."""
        if slots.release:
            await self._release(request.domain, slots.release, now)
        held: SlotOutcome | None = None
        if slots.acquire:
            answer = await self._store.acquire(slots.acquire, now)
            if not unanswered(answer):  # let through by the failure mode: nothing held
                held = answer
                pools = [p for _, p in taken(slots.acquire)]
                self._telemetry.slots.acquired(request.domain, pools, held)
                if not held.admitted:
                    self._telemetry.slots.refused(request.domain, slots.acquire)
                    return self._refused(request, slots)
        rates = None
        if slots.rates.descriptors:
            rates = await self._rates.decide(slots.rates, now, matcher, reserve=reserve)
        if held is not None and rates is not None and rates.code is Code.OVER_LIMIT:
            await self._release(request.domain, slots.acquire, now)
        return _placed(request, slots, rates)

    async def _release(self, domain: str, claims: tuple[Claim, ...], now: float) -> None:
        """Give slots back (one the store cannot take back expires after max_duration)."""
        given = await self._store.release(claims, now)
        self._telemetry.slots.released(domain, [p for _, p in taken(claims)], given)

    def _refused(self, request: Request, slots: Slots) -> Decision:
        statuses = [Status(Code.OK, None, 0, 0.0) for _ in request.descriptors]
        for claim in slots.acquire:
            statuses[claim.descriptor] = Status(Code.OVER_LIMIT, None, 0, 0.0, claim.pools[-1].rule)
        return Decision(Code.OK if self._shadow else Code.OVER_LIMIT, tuple(statuses))


def _placed(request: Request, slots: Slots, rates: Decision | None) -> Decision:
    """The rates' decision with a status at every descriptor of ``request`` as received:
    release descriptors answer OK (Envoy ignores the stream-done answer anyway)."""
    statuses = [Status(Code.OK, None, 0, 0.0) for _ in request.descriptors]
    if rates is None:
        return Decision(Code.OK, tuple(statuses))
    for position, status in zip(slots.positions, rates.statuses, strict=True):
        statuses[position] = status
    return Decision(rates.code, tuple(statuses), rates.backend_failed, rates.backend_seconds)
