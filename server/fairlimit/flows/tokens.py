"""The tokens flow: token budgets (core/reserve.py), reserved by request id, then settled.

A request that settles gives back (or charges as debt) the difference between what its
reservation charged and what it cost; one that reserves is decided by its rates (and slots,
when it takes any) with the reservations the store keeps if it admits. The estimate of an
unknown cost is the recent real costs' average (``averages``), kept here.
"""

import logging

from fairlimit.core.admission import Code, Status
from fairlimit.core.matching import Matcher
from fairlimit.core.plan import plan as make_plan
from fairlimit.core.request import Descriptor, Request
from fairlimit.core.reserve import (
    Averages,
    Reserve,
    Settle,
    Settled,
    TokenReport,
    Tokens,
    own_counter,
)
from fairlimit.core.reserve import split as split_tokens
from fairlimit.errors import ReservationOpen
from fairlimit.flows.decision import Active, Decision
from fairlimit.flows.rates import RatesFlow
from fairlimit.flows.slots import SlotsFlow
from fairlimit.policy.answers import unanswered
from fairlimit.store.base import Store
from fairlimit.telemetry import Telemetry

log = logging.getLogger(__name__)
UNPAIRED_LOGGED = 1024  # rules whose unpaired refunds are logged (once each), at most


class TokensFlow:
    """Decides requests that reserve or settle tokens; keeps the recent real costs."""

    def __init__(
        self,
        store: Store,
        telemetry: Telemetry,
        rates: RatesFlow,
        slots: SlotsFlow,
        shadow: bool,
    ) -> None:
        self._store = store  # the failure policy's: its answers are the failure mode's too
        self._telemetry = telemetry
        self._rates = rates
        self._slots = slots
        self._shadow = shadow
        self.averages = Averages()  # recent real costs: the estimate of last resort
        self._unpaired_seen: set[str] = set()  # rules whose unpaired refunds were logged
        self._id_open_logged = False  # a reservation by an open id was logged

    def split(self, request: Request, matcher: Matcher) -> Tokens | None:
        """``request``'s reservations and settlements, None when it has none."""
        return split_tokens(request, matcher, self.averages)

    async def decide(
        self, request: Request, tokens: Tokens, now: float, active: Active
    ) -> Decision:
        """Settle, then decide the rest with its reservations (core/reserve.py); settling
        and unpaired descriptors answer OK (Envoy ignores the stream-done answer)."""
        for settle in tokens.settle:
            await self._settle(request.domain, settle, now, active.matcher)
        if tokens.unpaired:
            # a domain the config does not have is not an attribute: any caller may send
            # any domain, one series each (found by fuzzing with hostile requests, issue 41)
            known = active.matcher.has_domain(request.domain)
            for rule in tokens.unpaired:
                self._unpaired(request.domain if known else "", rule)
        statuses = [Status(Code.OK, None, 0, 0.0) for _ in request.descriptors]
        rates = tokens.rates
        if not rates.descriptors:
            return Decision(Code.OK, tuple(statuses))
        slots = self._slots.split(rates, active)
        try:
            if slots is not None and (slots.acquire or slots.release):
                kept = {at: i for i, at in enumerate(slots.positions)}
                moved = tuple([_moved(r, kept[r.descriptor]) for r in tokens.reserve])
                inner = await self._slots.decide(rates, slots, now, active.matcher, moved)
            else:
                inner = await self._rates.decide(rates, now, active.matcher, reserve=tokens.reserve)
        except ReservationOpen:
            return self._id_open(request, tokens, statuses)
        if inner.code is Code.OK and tokens.reserve and not inner.backend_failed:
            for r in tokens.reserve:
                self._telemetry.tokens.reserved(request.domain, r.rule.path, r.hits)
        for position, status in zip(tokens.positions, inner.statuses, strict=True):
            statuses[position] = status
        return Decision(inner.code, tuple(statuses), inner.backend_failed,
                        inner.backend_seconds, inner.shed)  # fmt: skip

    def _unpaired(self, domain: str, rule: str) -> None:
        """A negative hit paired with no reservation: counted, and logged once per rule."""
        self._telemetry.tokens.settled(domain, rule, Settled(False))
        if rule not in self._unpaired_seen and len(self._unpaired_seen) < UNPAIRED_LOGGED:
            self._unpaired_seen.add(rule)
            log.warning(
                "negative hits paired with no reservation were ignored (logged "
                "once per rule): domain %s, rule %s",
                domain or "-",
                rule or "-",
            )

    def _id_open(self, request: Request, tokens: Tokens, statuses: list[Status]) -> Decision:
        """OVER_LIMIT for a request reserving by a request id whose reservation is still
        open: the store kept and charged nothing (two requests by one id would settle each
        other's reservation)."""
        rules = [r.rule.path for r in tokens.reserve]
        self._telemetry.tokens.id_open(request.domain, rules)
        if not self._id_open_logged:
            self._id_open_logged = True
            log.warning("a reservation by a request id that is still open was refused (logged "
                        "once; fairlimit.tokens.id_open counts them): domain %s, rule %s",
                        request.domain, rules[0] if rules else "-")  # fmt: skip
        for r in tokens.reserve:
            statuses[tokens.positions[r.descriptor]] = Status(Code.OVER_LIMIT, None, 0, 0.0, r.rule)
        return Decision(Code.OK if self._shadow else Code.OVER_LIMIT, tuple(statuses))

    async def _settle(self, domain: str, settle: Settle, now: float, matcher: Matcher) -> None:
        """One settlement; a store that is down leaves the reservation as charged."""
        plan = make_plan(Request(domain, (settle.descriptor,)), matcher)
        settled = await self._store.settle(plan, settle, now)
        if unanswered(settled):
            return
        self._telemetry.tokens.settled(domain, settle.rule.path, settled)
        own = own_counter(plan, 0)
        if settled.found and not settle.negative and own is not None:
            self.averages.add(plan.counters[own].key, settle.amount)

    async def report(
        self, domain: str, entries: tuple[tuple[str, str], ...], matcher: Matcher, now: float
    ) -> TokenReport | None:
        """The token budget of the client ``entries`` name (without a request id) at ``now``,
        at the rule with a reservation they match; None when they match none. Charges
        nothing; raises StoreUnavailable when the store cannot answer."""
        match = matcher.match(domain, entries)
        limit = None if match is None else match.rule.rate_limit
        if match is None or match.rule.reservation is None or limit is None:
            return None
        plan = make_plan(Request(domain, (Descriptor(entries, None, 0),)), matcher)
        usage = await self._store.usage(plan, now)
        return TokenReport(match.rule.path, limit.requests_per_unit, limit.window,
                           usage.charged, usage.reserved)  # fmt: skip


def _moved(reserve: Reserve, descriptor: int) -> Reserve:
    """``reserve`` at another index of the descriptors decided."""
    return Reserve(reserve.request_id, descriptor, reserve.hits, reserve.ttl, reserve.rule)
