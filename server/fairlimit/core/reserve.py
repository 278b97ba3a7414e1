"""Token budgets: reserve an estimate on the request path, settle it when the stream ends.

A descriptor whose last entry is the domain's ``acquire_key`` (``request_id``) and whose
rule (matched without that entry) declares ``reservation`` reserves an estimate of its
hits at every level it charges: the rule's limit and each ``fair_share`` cap above it. It
is admitted all or nothing like any other descriptor; a refused reservation consumes
nothing, an admitted one is kept by request id for ``max_duration`` seconds.

In the stream-done call the descriptor ending with ``release_key`` (``request_done``)
settles that id once: with ``hits_addend`` = the real cost, the unused part of the
reservation is given back (in the windows it was charged in only) and a cost above it is
charged as debt, even over the limit; with ``is_negative_hits`` it gives back at most what
the id reserved. An id that holds no open reservation (unknown, expired, settled already,
another client's) changes nothing. A negative-hits descriptor that pairs with nothing is
never charged: it is dropped from the request and counted (``Tokens.unpaired``).
"""

import math
from collections import OrderedDict
from dataclasses import dataclass

from fairlimit.core import concurrency
from fairlimit.core.keys import counter_key, key_paths
from fairlimit.core.matching import Match, Matcher
from fairlimit.core.plan import Plan
from fairlimit.core.plan import Reserve as Reserve  # kept with the plan that carries it
from fairlimit.core.request import Descriptor, Request
from fairlimit.core.rules import Config, Rule, walk

RECORD_SUFFIX = "#rsv:"
MAX_AVERAGES = 10_000  # counter keys whose average real cost is kept (least recent dropped)
AVERAGE_WEIGHT = 0.2  # EWMA weight of the newest real cost


@dataclass(slots=True)  # not frozen: built per request
class Settle:
    """A stream-done settlement (or an Envoy refund, ``negative``) of one request id."""

    request_id: str
    descriptor: Descriptor  # the entries without the id: the same levels as reserved
    amount: int  # the real cost, or with ``negative`` the hits to give back
    negative: bool
    ttl: float  # how long the settled id is remembered (duplicates dropped)
    rule: Rule


@dataclass(slots=True)  # not frozen: built per request
class Tokens:
    """A request split into its reservations, settlements and the rest."""

    reserve: tuple[Reserve, ...]
    settle: tuple[Settle, ...]
    unpaired: tuple[str, ...]  # rule paths ("" unmatched) of negative hits paired to nothing
    rates: Request  # what is decided as usual: reserving descriptors carry their estimate
    positions: tuple[int, ...]  # each rates descriptor's index in the request as received


@dataclass(frozen=True, slots=True)
class Usage:
    """A reserving rule's counter in its current window: ``charged`` (its count: the real
    costs settled, the estimates still reserved, and debt) and ``reserved`` (the estimates of
    the reservations made in this window and not settled: in flight, or expired unsettled
    and so charged at their estimate)."""

    charged: int
    reserved: int


@dataclass(frozen=True, slots=True)
class TokenReport:
    """A client's token budget now, for operators (the admin's /tokens): ``charged`` =
    ``used`` (settled real costs, and estimates of reservations that expired unsettled) +
    ``reserved`` (in flight); ``owed``: charged above the limit (debt), refused until the
    window ends."""

    rule: str
    limit: int
    window: int  # seconds
    charged: int
    reserved: int

    def as_json(self) -> dict[str, object]:
        return {"rule": self.rule, "limit": self.limit, "window_seconds": self.window,
                "charged": self.charged, "reserved": self.reserved,
                "used": self.charged - self.reserved,
                "owed": max(0, self.charged - self.limit),
                "remaining": max(0, self.limit - self.charged)}  # fmt: skip


@dataclass(frozen=True, slots=True)
class Settled:
    """What one settlement did: whether it found an open reservation, and the hits it gave
    back and charged as debt."""

    found: bool
    refund: int = 0
    debt: int = 0


def settlement(reserved: int, amount: int, negative: bool) -> tuple[int, int]:
    """(hits given back, hits charged as debt) for a reservation of ``reserved`` hits."""
    if negative:
        return min(amount, reserved), 0
    if amount < reserved:
        return reserved - amount, 0
    return 0, amount - reserved


def record_key(counter: str, request_id: str) -> str:
    """Where a reservation is kept: by its descriptor's own counter key and the id."""
    return f"{counter}{RECORD_SUFFIX}{request_id}"


def own_counter(plan: Plan, descriptor: int) -> int | None:
    """The index of the descriptor's own limit's counter (None when it charges none)."""
    charges = plan.descriptors[descriptor].charges
    if not charges or charges[0].share is not None:
        return None
    return charges[0].counter


def levels(plan: Plan, descriptor: int) -> tuple[list[int], list[int]]:
    """The counters and shares (indexes into the plan) the descriptor charges."""
    charges = plan.descriptors[descriptor].charges
    counters = [c.counter for c in charges]
    shares = [c.share for c in charges if c.share is not None]
    return counters, shares


class Averages:
    """The recent average real cost per counter key (an EWMA), for at most ``capacity``
    keys: the least recently settled are forgotten first."""

    def __init__(self, capacity: int = MAX_AVERAGES) -> None:
        self._capacity = capacity
        self._values: OrderedDict[str, float] = OrderedDict()

    def __len__(self) -> int:
        return len(self._values)

    def get(self, key: str) -> int | None:
        value = self._values.get(key)
        return None if value is None else max(1, math.ceil(value))

    def add(self, key: str, cost: int) -> None:
        known = self._values.pop(key, None)
        value = float(cost) if known is None else known + AVERAGE_WEIGHT * (cost - known)
        self._values[key] = value
        if len(self._values) > self._capacity:
            self._values.popitem(last=False)


def declared(config: Config) -> bool:
    """Whether any rule of ``config`` declares a reservation."""
    return any(
        rule.reservation is not None
        for domain in config.domains.values()
        for rule, _ in walk(domain.rules)
    )


def average_key(domain: str, entries: tuple[tuple[str, str], ...], match: Match) -> str:
    """The counter key a descriptor's own limit is counted under (its averages' key)."""
    limit = match.rule.rate_limit
    assert limit is not None
    return counter_key(key_paths(domain, entries, match.shared)[-1], limit.window)


def _estimate(request: Request, descriptor: Descriptor, match: Match, key: str,
              averages: Averages) -> int:  # fmt: skip
    """The descriptor's hits_addend, else the request's, else the rule's default, else the
    client's recent average real cost, else 1 (a hits_addend of 0 counts as none)."""
    if descriptor.hits:
        return descriptor.hits
    if request.hits:
        return request.hits
    reservation = match.rule.reservation
    assert reservation is not None
    if reservation.default is not None:
        return reservation.default
    return averages.get(key) or 1


def _reserving(request: Request, descriptor: Descriptor, matcher: Matcher) -> Match | None:
    """The match of a descriptor that ends with a request id entry and whose rule declares
    a reservation."""
    domain = matcher.config.domains.get(request.domain)
    entries = descriptor.entries
    if domain is None or len(entries) < 2:
        return None
    if entries[-1][0] not in (domain.acquire_key, domain.release_key):
        return None
    match = matcher.match(request.domain, entries[:-1])
    if match is None or match.rule.reservation is None:
        return None
    return match


def _releases_slots(request: Request, descriptor: Descriptor, matcher: Matcher) -> bool:
    """Whether a negative-hits descriptor gives back concurrency slots by its request id."""
    alone = Request(request.domain, (descriptor,), 0)
    return bool(concurrency.split(alone, matcher).release)


def split(request: Request, matcher: Matcher, averages: Averages) -> Tokens | None:
    """``request``'s reservations and settlements; None when it has none and no negative
    hits (then it is decided as before)."""
    reserve: list[Reserve] = []
    settle: list[Settle] = []
    unpaired: list[str] = []
    kept: list[Descriptor] = []
    positions: list[int] = []
    for index, descriptor in enumerate(request.descriptors):
        match = _reserving(request, descriptor, matcher)
        if match is None:
            if descriptor.negative and not _releases_slots(request, descriptor, matcher):
                found = matcher.match(request.domain, descriptor.entries)
                unpaired.append(found.rule.path if found is not None else "")
                continue
            kept.append(descriptor)
            positions.append(index)
            continue
        reservation = match.rule.reservation
        assert reservation is not None
        (key, request_id), entries = descriptor.entries[-1], descriptor.entries[:-1]
        stripped = Descriptor(entries, descriptor.limit, descriptor.hits)
        domain = matcher.config.domains[request.domain]
        if key == domain.release_key:
            amount = request.hits if descriptor.hits is None else descriptor.hits
            settle.append(Settle(request_id, stripped, amount, descriptor.negative,
                                 reservation.max_duration, match.rule))  # fmt: skip
            continue
        if descriptor.negative:  # a refund on the request path pairs with nothing
            unpaired.append(match.rule.path)
            continue
        average = average_key(request.domain, entries, match)
        hits = _estimate(request, descriptor, match, average, averages)
        reserve.append(Reserve(request_id, len(kept), hits, reservation.max_duration,
                               match.rule))  # fmt: skip
        kept.append(Descriptor(entries, descriptor.limit, hits))
        positions.append(index)
    if not reserve and not settle and not unpaired:
        return None
    rates = Request(request.domain, tuple(kept), request.hits)
    return Tokens(tuple(reserve), tuple(settle), tuple(unpaired), rates, tuple(positions))
