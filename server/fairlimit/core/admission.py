"""What a request charges, and the decision from counter values.

A request is all or nothing: it is admitted only if every counter and every fair-share
claim it touches admits it, and only then does any counter move. The store applies this
rule atomically (``store/memory.py`` in Python, ``store/lua/admit.lua`` for Redis); this
module says what the rule is.
"""

import dataclasses
import enum
import math
from collections.abc import Sequence
from dataclasses import dataclass

from fairlimit.core.matching import Entry, Match, Matcher
from fairlimit.core.rules import RateLimit, Rule
from fairlimit.core.units import seconds_until_reset
from fairlimit.errors import RequestError

# The request, its plan, the store's outcome and the statuses are built on every
# request, so they are slotted but not frozen: a frozen dataclass's __init__ sets each field
# through object.__setattr__, about five times the cost, and these classes hold some forty
# fields per request between them. Nothing changes one after it is built.
UNLIMITED_REMAINING = 4294967295
_EPSILON = 1e-9


class Code(enum.Enum):
    OK = 1
    OVER_LIMIT = 2


@dataclass(slots=True)  # not frozen: built per request (see the note above)
class Descriptor:
    """One request descriptor: its entries, an optional limit override and hits."""

    entries: tuple[Entry, ...]
    limit: RateLimit | None = None
    hits: int | None = None


@dataclass(slots=True)  # not frozen: built per request (see the note above)
class Request:
    """A ShouldRateLimit request, free of the wire format."""

    domain: str
    descriptors: tuple[Descriptor, ...]
    hits: int = 0  # request-level hits_addend; 0 means 1

    def hits_for(self, descriptor: Descriptor) -> int:
        if descriptor.hits is not None:
            return descriptor.hits
        return self.hits or 1


@dataclass(slots=True)  # not frozen: built per request (see the note above)
class Counter:
    """A fixed-window counter the request is checked and charged against."""

    key: str
    limit: int
    window: int
    hits: int
    shadow: bool


@dataclass(slots=True)  # not frozen: built per request (see the note above)
class Share:
    """A client's claim at a fair-share cap (all amounts in the cap's window)."""

    cap: str  # the cap's counter key
    client: str
    capacity: int
    window: int
    client_limit: float
    weight: float
    hits: int
    shadow: bool
    declared: int

    @property
    def period(self) -> float:
        """How often λ is recomputed: P = min(window, 1 s)."""
        return float(min(self.window, 1))


@dataclass(slots=True)  # not frozen: built per request (see the note above)
class Level:
    """One level a descriptor is charged against."""

    counter: int  # index into Plan.counters
    share: int | None  # index into Plan.shares, for a cap
    limit: RateLimit
    rule: Rule | None


@dataclass(slots=True)  # not frozen: built per request (see the note above)
class DescriptorPlan:
    rule: Rule | None
    levels: tuple[Level, ...]
    unlimited: bool = False


@dataclass(slots=True)  # not frozen: built per request (see the note above)
class Plan:
    """Everything a request charges, deduplicated across its descriptors."""

    descriptors: tuple[DescriptorPlan, ...]
    counters: tuple[Counter, ...]
    shares: tuple[Share, ...]


def escape(part: str) -> str:
    """Escape a key or value so that joined paths never collide."""
    if "\\" in part or "/" in part or "=" in part:
        return part.replace("\\", "\\\\").replace("/", "\\/").replace("=", "\\=")
    return part  # the common case: nothing to escape, no new string


def _paths(domain: str, entries: Sequence[Entry]) -> list[str]:
    """The key paths of ``entries[:1]``, ``entries[:2]``, ... (a counter key less ``#window``).

    A cap's key is a prefix of its clients' keys, so a descriptor's keys share one walk.
    """
    path = escape(domain)
    out: list[str] = []
    for k, v in entries:
        path = f"{path}/{escape(k)}={escape(v)}"
        out.append(path)
    return out


def counter_key(domain: str, entries: Sequence[Entry], window: int) -> str:
    """The store key of the counter for ``entries`` in a window of ``window`` seconds."""
    paths = _paths(domain, entries)
    return f"{paths[-1] if paths else escape(domain)}#{window}"


class _Builder:
    """Collects counters and shares, summing the hits of repeats (indexes kept by key)."""

    __slots__ = ("_counter_at", "_share_at", "counters", "shares")

    def __init__(self) -> None:
        self.counters: list[Counter] = []
        self.shares: list[Share] = []
        self._counter_at: dict[str, int] = {}
        self._share_at: dict[tuple[str, str], int] = {}

    def counter(self, key: str, limit: RateLimit, hits: int, shadow: bool) -> int:
        at = self._counter_at.get(key)
        if at is None:
            at = self._counter_at[key] = len(self.counters)
            self.counters.append(Counter(key, limit.requests_per_unit, limit.window, hits, shadow))
            return at
        known = self.counters[at]
        self.counters[at] = Counter(key, known.limit, known.window, known.hits + hits, known.shadow)
        return at

    def share(self, share: Share) -> int:
        ident = (share.cap, share.client)
        at = self._share_at.get(ident)
        if at is None:
            at = self._share_at[ident] = len(self.shares)
            self.shares.append(share)
            return at
        known = self.shares[at]
        self.shares[at] = dataclasses.replace(known, hits=known.hits + share.hits)
        return at


def _cap_levels(
    builder: _Builder,
    paths: Sequence[str],
    descriptor: Descriptor,
    hits: int,
    trail: Sequence[Rule],
    replaced: set[str],
) -> list[Level]:
    levels: list[Level] = []
    for depth in range(len(trail) - 1):
        cap = trail[depth]
        limit, fair_share = cap.rate_limit, cap.fair_share
        if fair_share is None or limit is None or limit.name in replaced:
            continue
        key = f"{paths[depth]}#{limit.window}"
        child_limit = trail[depth + 1].rate_limit
        per_client = (
            math.inf
            if child_limit is None or child_limit.unlimited
            else child_limit.per_second * limit.window
        )
        client = descriptor.entries[depth + 1][1]
        share = Share(
            key,
            client,
            limit.requests_per_unit,
            limit.window,
            per_client,
            fair_share.weight(client),
            hits,
            cap.shadow_mode,
            fair_share.active_clients,
        )
        counter = builder.counter(key, limit, hits, cap.shadow_mode)
        levels.append(Level(counter, builder.share(share), limit, cap))
    return levels


def _descriptor_plan(
    builder: _Builder,
    request: Request,
    descriptor: Descriptor,
    match: Match | None,
    replaced: set[str],
) -> DescriptorPlan:
    rule = match.rule if match else None
    limit = descriptor.limit or (rule.rate_limit if rule else None)
    if limit is not None and limit.unlimited:
        return DescriptorPlan(rule, (), unlimited=True)
    levels: list[Level] = []
    charged = limit is not None and limit.name not in replaced
    if not charged and (match is None or len(match.trail) < 2):
        return DescriptorPlan(rule, ())  # nothing to charge: no key to build
    paths = _paths(request.domain, descriptor.entries)
    hits = request.hits_for(descriptor)
    if charged:
        assert limit is not None
        shadow = rule is not None and rule.shadow_mode and descriptor.limit is None
        counter = builder.counter(f"{paths[-1]}#{limit.window}", limit, hits, shadow)
        levels.append(Level(counter, None, limit, rule))
    if match is not None:
        levels.extend(_cap_levels(builder, paths, descriptor, hits, match.trail, replaced))
    return DescriptorPlan(rule, tuple(levels))


def plan(request: Request, matcher: Matcher) -> Plan:
    """What ``request`` charges under the configuration of ``matcher``.

    Each descriptor charges its matched limit (or the request's override) and every
    ``fair_share`` cap above it; limits named in any charged limit's ``replaces`` drop out.
    """
    if not matcher.has_domain(request.domain):
        return Plan(tuple(DescriptorPlan(None, ()) for _ in request.descriptors), (), ())
    matches = [matcher.match(request.domain, d.entries) for d in request.descriptors]
    replaced: set[str] = set()
    for descriptor, match in zip(request.descriptors, matches, strict=True):
        limit = descriptor.limit or (match.rule.rate_limit if match else None)
        if limit is not None and limit.replaces:
            replaced.update(limit.replaces)
    builder = _Builder()
    plans = tuple(
        _descriptor_plan(builder, request, d, m, replaced)
        for d, m in zip(request.descriptors, matches, strict=True)
    )
    return Plan(plans, tuple(builder.counters), tuple(builder.shares))


def counter_over(counter: Counter, count: int) -> bool:
    """Whether ``counter`` standing at ``count`` refuses this request (shadow never does)."""
    return not counter.shadow and count + max(counter.hits, 1) > counter.limit


def share_bound(share: Share, level: float | None, seen_weight: float) -> float:
    """The most ``share.client`` may have admitted at the cap this window.

    ``level`` is λ for the current period; None means the cap has no history yet, and the
    capacity is split by weight among the clients seen so far (``seen_weight``).
    """
    if level is None:
        fair = share.capacity * share.weight / max(seen_weight, share.weight)
    else:
        fair = level * share.weight
    return min(share.client_limit, fair)


def share_over(share: Share, admitted: int, bound: float) -> bool:
    """Whether the client's claim at the cap exceeds its bound (shadow caps never do)."""
    return not share.shadow and admitted + max(share.hits, 1) > bound + _EPSILON


def admits(
    plan: Plan, counts: Sequence[int], shared: Sequence[int], bounds: Sequence[float]
) -> bool:
    """The all-or-nothing decision from the counters as they stand."""
    for c, n in zip(plan.counters, counts, strict=True):
        if counter_over(c, n):
            return False
    return not any(share_over(s, a, b) for s, a, b in zip(plan.shares, shared, bounds, strict=True))


@dataclass(slots=True)  # not frozen: built per request (see the note above)
class Outcome:
    """What the store saw: the counters before the charge, and whether it was made."""

    admitted: bool
    counts: tuple[int, ...]  # per Plan.counters
    shared: tuple[int, ...]  # per Plan.shares: the client's admitted count at the cap
    bounds: tuple[float, ...]  # per Plan.shares: min(L_i, fair share) in force
    now: float | None = None  # the store's own clock when it keeps one (Redis TIME)


@dataclass(slots=True)  # not frozen: built per request (see the note above)
class Status:
    """One descriptor's answer, ready for Envoy's X-RateLimit headers."""

    code: Code
    current_limit: RateLimit | None
    limit_remaining: int
    duration_until_reset: float
    rule: Rule | None = None
    shadowed: bool = False  # over a shadow-mode limit, answered OK


def _level_view(plan: Plan, outcome: Outcome, level: Level) -> tuple[bool, bool, int, float]:
    """(over, shadow_over, remaining, fair limit) of one level."""
    counter = plan.counters[level.counter]
    before = outcome.counts[level.counter]
    charged = counter.hits if outcome.admitted else 0
    over = counter.limit < before + max(counter.hits, 1)
    remaining = counter.limit - before - charged
    fair = math.inf
    if level.share is not None:
        share = plan.shares[level.share]
        bound = outcome.bounds[level.share]
        had = outcome.shared[level.share]
        over = over or share_over(share, had, bound)
        if bound != math.inf:
            remaining = min(remaining, math.floor(bound + _EPSILON) - had - charged)
            fair = bound
    if counter.shadow:
        return False, over, max(0, remaining), fair
    return over, False, max(0, remaining), fair


def _effective_limit(leaf: RateLimit, level: Level, fair: float) -> RateLimit:
    if fair == math.inf or fair / level.limit.window >= leaf.per_second:
        return leaf
    return RateLimit(math.floor(fair + _EPSILON), level.limit.unit, name=leaf.name)


def _status(plan: Plan, outcome: Outcome, dplan: DescriptorPlan, now: float) -> Status:
    """A charged descriptor's status: the tightest level's remaining and reset."""
    over = shadowed = False
    leaf = effective = dplan.levels[0].limit
    best_remaining, best_window = -1, 0
    for level in dplan.levels:
        lv_over, lv_shadow, remaining, fair = _level_view(plan, outcome, level)
        over, shadowed = over or lv_over, shadowed or lv_shadow
        if best_remaining < 0 or remaining < best_remaining:
            best_remaining, best_window = remaining, plan.counters[level.counter].window
        if fair != math.inf:
            candidate = _effective_limit(leaf, level, fair)
            if candidate.per_second < effective.per_second:
                effective = candidate
    code = Code.OVER_LIMIT if over else Code.OK
    reset = seconds_until_reset(best_window, now)
    return Status(code, effective, best_remaining, reset, dplan.rule, shadowed)


def statuses(plan: Plan, outcome: Outcome, now: float) -> tuple[Status, ...]:
    """Each descriptor's status from the plan and what the store saw."""
    out: list[Status] = []
    for dplan in plan.descriptors:
        if dplan.unlimited:
            out.append(Status(Code.OK, None, UNLIMITED_REMAINING, 0.0, dplan.rule))
        elif not dplan.levels:
            out.append(Status(Code.OK, None, 0, 0.0, dplan.rule))
        else:
            out.append(_status(plan, outcome, dplan, now))
    return tuple(out)


def overall(statuses_: Sequence[Status]) -> Code:
    """OVER_LIMIT when any descriptor is over, else OK."""
    return Code.OVER_LIMIT if any(s.code is Code.OVER_LIMIT for s in statuses_) else Code.OK


__all__ = [
    "Code",
    "Counter",
    "Descriptor",
    "DescriptorPlan",
    "Level",
    "Outcome",
    "Plan",
    "Request",
    "Share",
    "Status",
    "admits",
    "counter_key",
    "overall",
    "plan",
    "share_bound",
    "share_over",
    "statuses",
]


MAX_DESCRIPTORS = 64
MAX_ENTRIES = 16
MAX_TEXT = 1024
MAX_HITS = 0xFFFFFFFF


def validate(request: Request) -> None:
    """Reject requests no Envoy would send, or that would abuse the server (RequestError)."""
    if not request.domain:
        raise RequestError("rate limit domain must not be empty")
    if not request.descriptors:
        raise RequestError("rate limit descriptor list must not be empty")
    if len(request.descriptors) > MAX_DESCRIPTORS:
        raise RequestError(f"at most {MAX_DESCRIPTORS} descriptors per request")
    if len(request.domain) > MAX_TEXT or request.hits > MAX_HITS:
        raise RequestError(f"domain longer than {MAX_TEXT} or hits_addend above {MAX_HITS}")
    for index, descriptor in enumerate(request.descriptors):
        entries = descriptor.entries
        if not entries or len(entries) > MAX_ENTRIES:
            raise RequestError(
                f"descriptor {index} has no entries"
                if not entries
                else f"descriptor {index} has more than {MAX_ENTRIES} entries"
            )
        longest = max([len(k) for k, _ in entries] + [len(v) for _, v in entries])
        if longest > MAX_TEXT:
            raise RequestError(f"descriptor {index} has an entry longer than {MAX_TEXT}")
        if not all([k for k, _ in entries]):
            raise RequestError(f"descriptor {index} has an entry with an empty key")
        if descriptor.hits is not None and descriptor.hits > MAX_HITS:
            raise RequestError(f"descriptor {index} hits_addend above {MAX_HITS}")
