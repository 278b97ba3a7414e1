"""What a request charges: its counters and fair-share claims, deduplicated.

Each descriptor charges its matched limit (or the request's override) and every
``fair_share`` cap above it; limits named in any charged limit's ``replaces`` drop out.
"""

import dataclasses
from collections.abc import Sequence
from dataclasses import dataclass

from fairlimit.core.keys import counter_key, key_paths
from fairlimit.core.matching import Match, Matcher
from fairlimit.core.request import Descriptor, Request
from fairlimit.core.rules import RateLimit, Rule, most_within
from fairlimit.core.units import Shape


# A plan is built on every request, so its classes are slotted but not frozen: a frozen
# dataclass's __init__ sets each field through object.__setattr__, about five times the
# cost, and a plan holds dozens of fields. Nothing changes one after it is built.
@dataclass(slots=True)
class Counter:
    """A counter the request is checked and charged against: a fixed window of ``window``
    seconds, or what ``shape`` says (a calendar window, a sliding window, GCRA)."""

    key: str
    limit: int
    window: int
    hits: int
    shadow: bool
    force: bool = False  # charged even when the request is refused (charge_when_over_limit)
    shape: Shape | None = None


@dataclass(slots=True)  # not frozen: built per request (see Counter)
class Share:
    """A client's claim at a fair-share cap (all amounts in the cap's window)."""

    cap: str  # the cap's counter key
    client: str
    capacity: int
    window: int
    client_limit: float  # the most its own limits admit in one window of the cap's
    weight: float
    hits: int
    shadow: bool
    declared: int
    total: int = -1  # index into Plan.counters of the cap's own counter
    force: bool = False  # charged even when the request is refused (charge_when_over_limit)

    @property
    def sized(self) -> bool:
        """The cap holds ``declared`` clients at this client's limit: never paced."""
        return self.capacity >= self.declared * self.client_limit

    @property
    def period(self) -> float:
        """How often λ is recomputed: P = min(window, 1 s)."""
        return float(min(self.window, 1))


@dataclass(slots=True)  # not frozen: built per request (see Counter)
class Charge:
    """One level a descriptor is charged at: a counter, and a claim when it is a cap."""

    counter: int  # index into Plan.counters
    share: int | None  # index into Plan.shares, for a cap
    limit: RateLimit
    rule: Rule | None
    shadow: bool  # its rule's shadow_mode: over it, its status says OK


@dataclass(slots=True)  # not frozen: built per request (see Counter)
class DescriptorPlan:
    rule: Rule | None
    charges: tuple[Charge, ...]  # its own limit first, then the caps above, outermost first
    unlimited: bool = False
    match: Match | None = None  # how the rule was reached (upstream-named metrics read it)


@dataclass(slots=True)  # not frozen: built per request (see Counter)
class Reserve:
    """A reservation to keep if the request is admitted (core/reserve.py makes them from
    the request; the plan carries them to the store)."""

    request_id: str
    descriptor: int  # index into the rates request's descriptors (and so the plan's)
    hits: int  # the estimate reserved
    ttl: float  # max_duration
    rule: Rule


@dataclass(slots=True)  # not frozen: built per request (see Counter)
class Plan:
    """Everything a request charges, deduplicated across its descriptors."""

    descriptors: tuple[DescriptorPlan, ...]
    counters: tuple[Counter, ...]
    shares: tuple[Share, ...]
    reserve: tuple[Reserve, ...] = ()  # kept by the store when admitted (core/reserve.py)


class _Builder:
    """Collects counters and shares, summing the hits of repeats (indexes kept by key)."""

    __slots__ = ("_counter_at", "_share_at", "counters", "shares")

    def __init__(self) -> None:
        self.counters: list[Counter] = []
        self.shares: list[Share] = []
        self._counter_at: dict[str, int] = {}
        self._share_at: dict[tuple[str, str], int] = {}

    def counter(self, key: str, limit: RateLimit, hits: int, shadow: bool, force: bool) -> int:
        at = self._counter_at.get(key)
        if at is None:
            at = self._counter_at[key] = len(self.counters)
            self.counters.append(
                Counter(
                    key, limit.requests_per_unit, limit.window, hits, shadow, force, limit.shape
                )
            )
            return at
        # Two descriptors of one key may give two limits (a limit override beside the rule's,
        # or two overrides): the counter holds the tighter, as upstream's shared counter
        # refuses when either descriptor's own limit is passed; each status names its own
        # limit and reports what the counter has left under the tighter (core/admission.py).
        # It kept the first: 1/year after 10/year on one key admitted 10 a year (found by
        # fuzzing accepted configs, issue 41).
        # Likewise the counter refuses unless every descriptor on it is in shadow mode (a
        # shadow rule's key beside an override's, never shadow): it kept the first's, so
        # the override went unenforced behind a shadow rule; each status still says OK
        # over a shadow limit (its charge's shadow, core/admission.py).
        known = self.counters[at]
        tighter = min(known.limit, limit.requests_per_unit)
        self.counters[at] = Counter(
            key, tighter, known.window, known.hits + hits, known.shadow and shadow,
            known.force or force, known.shape,
        )  # fmt: skip
        return at

    def share(self, share: Share) -> int:
        ident = (share.cap, share.client)
        at = self._share_at.get(ident)
        if at is None:
            at = self._share_at[ident] = len(self.shares)
            self.shares.append(share)
            return at
        known = self.shares[at]
        force = known.force or share.force
        self.shares[at] = dataclasses.replace(known, hits=known.hits + share.hits, force=force)
        return at


def _cap_charges(
    builder: _Builder,
    paths: Sequence[str],
    descriptor: Descriptor,
    hits: int,
    trail: Sequence[Rule],
    replaced: set[str],
    force: bool,
) -> list[Charge]:
    """Each fair_share cap above the descriptor, each of its limits a claim of its own."""
    charges: list[Charge] = []
    for depth in range(len(trail) - 1):
        cap, fair_share = trail[depth], trail[depth].fair_share
        if fair_share is None:
            continue
        child = trail[depth + 1].limits
        client = descriptor.entries[depth + 1][1]
        for limit in cap.limits:
            if limit.name in replaced:
                continue
            key = counter_key(paths[depth], limit.window)
            share = Share(
                key,
                client,
                limit.requests_per_unit,
                limit.window,
                most_within(child, limit.window),
                fair_share.weight(client),
                hits,
                cap.shadow_mode,
                fair_share.active_clients,
                builder.counter(key, limit, hits, cap.shadow_mode, force),
                force,
            )
            charges.append(Charge(share.total, builder.share(share), limit, cap, cap.shadow_mode))
    return charges


def _forced(limit: RateLimit, default: bool) -> bool:
    """Whether ``limit`` is charged when the request is refused (its own word, or ``default``)."""
    said = limit.charge_when_over_limit
    return default if said is None else said


def _descriptor_plan(
    builder: _Builder,
    request: Request,
    descriptor: Descriptor,
    match: Match | None,
    replaced: set[str],
    charge_over: bool,
) -> DescriptorPlan:
    rule = match.rule if match else None
    limit = descriptor.limit or (rule.rate_limit if rule else None)
    if limit is not None and limit.unlimited:
        return DescriptorPlan(rule, (), unlimited=True, match=match)
    charges: list[Charge] = []
    own = (limit,) if descriptor.limit is not None or rule is None else rule.limits
    charged = [lim for lim in own if lim is not None and lim.name not in replaced]
    if not charged and (match is None or len(match.trail) < 2):
        return DescriptorPlan(rule, (), match=match)  # nothing to charge: no key to build
    shared = match.shared if match is not None and descriptor.limit is None else ()
    paths = key_paths(request.domain, descriptor.entries, shared)
    hits = request.hits_for(descriptor)
    # The config-wide default is upstream's semantics for configs that cannot say otherwise;
    # a descriptor under a fair_share cap is fairlimit's own, and a refused request there
    # consumes nothing unless its rule says so (a cap charged by refusals is not shared).
    under_cap = match is not None and any(r.fair_share is not None for r in match.trail[:-1])
    force = limit is not None and _forced(limit, charge_over and not under_cap)
    shadow = rule is not None and rule.shadow_mode and descriptor.limit is None
    for each in charged:
        key = counter_key(paths[-1], each.window, each.shape)
        counter = builder.counter(
            key, each, hits, shadow, _forced(each, charge_over and not under_cap)
        )
        charges.append(Charge(counter, None, each, rule, shadow))
    if match is not None:
        trail = match.trail
        charges.extend(_cap_charges(builder, paths, descriptor, hits, trail, replaced, force))
    return DescriptorPlan(rule, tuple(charges), match=match)


def plan(request: Request, matcher: Matcher) -> Plan:
    """What ``request`` charges under the configuration of ``matcher``."""
    if not matcher.has_domain(request.domain):
        return Plan(tuple(DescriptorPlan(None, ()) for _ in request.descriptors), (), ())
    matches = [matcher.match(request.domain, d.entries) for d in request.descriptors]
    replaced: set[str] = set()
    for descriptor, match in zip(request.descriptors, matches, strict=True):
        own = (descriptor.limit,) if descriptor.limit or not match else match.rule.limits
        for limit in own:
            if limit is not None and limit.replaces:
                replaced.update(limit.replaces)
    builder = _Builder()
    charge_over = matcher.config.charge_over_limit
    plans = tuple(
        _descriptor_plan(builder, request, d, m, replaced, charge_over)
        for d, m in zip(request.descriptors, matches, strict=True)
    )
    return Plan(plans, tuple(builder.counters), tuple(builder.shares))
