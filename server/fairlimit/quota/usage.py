"""Reported RLQS usage -> the store's counters, dripped over the interval after each report.

Envoy reports seconds of usage at once (every 5 s in Envoy 1.40). Charged in one go, a
report would fill a 1 s counter five times over in one window and leave the next four
empty, so RLS requests at the same cap would see the RLQS traffic as one burst. Instead each
bucket's reported allowed requests are owed and paid into the counters at the rate they were
reported, over the next reporting interval, by ``drip`` (the app calls it a few times a
second). Usage thus reaches the shared counters one interval late, at its average rate.

Payments are charged through the same plan an RLS request with ``hits_addend`` = the payment
would charge, with every level in shadow mode: the store records them even past a limit (the
requests have passed already) and refuses nothing.
"""

import dataclasses
import logging
import math
from collections import defaultdict

from fairlimit.core.bucket import BucketKey
from fairlimit.core.matching import Entry, Matcher
from fairlimit.core.plan import Plan
from fairlimit.core.plan import plan as make_plan
from fairlimit.core.request import Descriptor, Request
from fairlimit.errors import StoreUnavailable
from fairlimit.store.base import Store

log = logging.getLogger(__name__)

Owner = tuple[int, BucketKey]  # (stream, bucket)


class _Debt:
    """Allowed requests of one stream's bucket not yet in the counters."""

    __slots__ = ("domain", "due", "entries", "owed", "rate")

    def __init__(self, domain: str, entries: tuple[Entry, ...]) -> None:
        self.domain, self.entries = domain, entries
        self.owed = 0.0  # requests still to charge
        self.due = 0.0  # fraction of a request paid for but not yet charged
        self.rate = 0.0  # requests/s to pay at; math.inf pays everything at the next drip


class UsageLedger:
    """What every stream's buckets owe the counters, and the drip that pays it."""

    def __init__(self, store: Store) -> None:
        self.store = store
        self._debts: dict[Owner, _Debt] = {}
        self._dripped: float | None = None

    def owe(
        self, owner: Owner, domain: str, entries: tuple[Entry, ...], allowed: int, interval: float
    ) -> None:
        """A report of ``allowed`` requests: pay them (and what is left) over ``interval``."""
        debt = self._debts.get(owner)
        if debt is None or debt.entries != entries or debt.domain != domain:
            debt = self._debts[owner] = _Debt(domain, entries)
        debt.owed += allowed
        debt.rate = debt.owed / interval

    def pay_off(self, stream: int) -> None:
        """The stream ended: what its buckets owe is paid at the next drip."""
        for (ident, _), debt in self._debts.items():
            if ident == stream:
                debt.rate = math.inf

    async def drip(self, now: float, matcher: Matcher) -> None:
        """Pay what is due since the last drip, in one store call per domain."""
        elapsed = 0.0 if self._dripped is None else max(0.0, now - self._dripped)
        self._dripped = now
        payments: dict[str, list[Descriptor]] = defaultdict(list)
        for owner, debt in list(self._debts.items()):
            pay = debt.owed if math.isinf(debt.rate) else min(debt.owed, debt.rate * elapsed)
            debt.owed -= pay
            debt.due += pay
            hits = math.floor(debt.due + 1e-9)
            if debt.owed <= 1e-9 and math.isinf(debt.rate):
                hits = math.ceil(debt.due - 1e-9)  # the last payment of a closed stream
            if hits > 0:
                debt.due -= hits
                payments[debt.domain].append(Descriptor(debt.entries, None, hits))
            if debt.owed <= 1e-9 and (math.isinf(debt.rate) or debt.due <= 0):
                del self._debts[owner]
        for domain, descriptors in payments.items():
            await self._charge(
                recorded(make_plan(Request(domain, tuple(descriptors)), matcher)), now
            )

    async def _charge(self, plan: Plan, now: float) -> None:
        if not plan.counters:
            return
        try:
            await self.store.admit(plan, now)
        except StoreUnavailable as exc:
            # The assignments live in this process and go on; the shared counters miss
            # this payment, as RLS answers would under --failure-mode open.
            log.warning("RLQS usage not recorded: backend unavailable: %s", exc)

    @property
    def owed(self) -> float:
        """Requests reported but not yet in the counters (for tests and /rlconfig)."""
        return sum(d.owed + d.due for d in self._debts.values())


def recorded(plan: Plan) -> Plan:
    """``plan`` with every level in shadow mode: the store admits it whatever the counters
    say and charges every level (shadow levels count as admitted)."""
    return Plan(
        plan.descriptors,
        tuple(dataclasses.replace(c, shadow=True) for c in plan.counters),
        tuple(dataclasses.replace(s, shadow=True) for s in plan.shares),
    )
