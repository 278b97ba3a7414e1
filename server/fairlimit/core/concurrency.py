"""Concurrency caps: which slots a request takes or gives back, and the fair split of a cap.

Envoy sends the request id as the last entry of a descriptor (``request_headers`` on
``x-request-id``). On the request path that entry's key is the domain's ``acquire_key``
(``request_id``); in the ``apply_on_stream_done`` call, a separate ShouldRateLimit made when
the stream ends, it is the ``release_key`` (``request_done``). ``split`` takes that entry off
and matches the rest as usual: when the matched rule, or a ``fair_share`` cap above it,
declares ``concurrency``, the descriptor claims a slot in each such pool. An acquire
descriptor still carries its rate limits (the rest of its entries); a release descriptor
carries none, so the stream-done call never charges a rate. A descriptor whose rule declares
no concurrency is matched whole, as if the entry were an ordinary one.

A rule whose ``concurrency`` says ``released_by: negative_hits`` pairs without request ids:
a descriptor stopping at it (matched whole) takes a slot under an id the limiter makes up
(``anonymous``), and a descriptor with ``is_negative_hits`` gives back one slot of that
client (the one that expires first; ``ANY``), or nothing when it holds none.

A pool is a set of request ids, each with an expiry. A rule's pool is per client when the
rule is value-less (its path holds the value), as rate limits are. A cap's pool holds every
client's ids, and a client may hold at most ``fair_bound`` of it: weighted max-min fairness
over each client's demand (slots held plus slots refused in the last second), its
per-client ``max_in_flight`` and its ``fair_share`` weight.
"""

import math
from collections.abc import Iterator, Mapping, Sequence
from dataclasses import dataclass

from fairlimit.core.fairshare import water_level
from fairlimit.core.keys import key_paths
from fairlimit.core.matching import Match, Matcher
from fairlimit.core.request import Descriptor, Request
from fairlimit.core.rules import Config, Domain, Rule, walk
from fairlimit.core.validation import Classification, Mode

POOL_SUFFIX = "#inflight"
ANY = ""  # a release's request id: whichever slot of the client expires first
DEMAND_PERIOD = 1.0  # seconds a refused acquire counts as demand at a cap
_EPSILON = 1e-9


@dataclass(slots=True)  # not frozen: built per request (see core/plan.py)
class Pool:
    """One pool of slots a claim takes one of."""

    key: str  # the rule's key path + POOL_SUFFIX
    rule: Rule
    limit: int  # max_in_flight
    ttl: float  # seconds until a slot expires
    anchor: str  # the key path of the outermost cap over it (its own path when none)
    client: str | None = None  # at a fair_share cap: the client value below the cap
    client_limit: float = math.inf  # at a cap: the client's own max_in_flight
    weight: float = 1.0


@dataclass(slots=True)  # not frozen: built per request
class Claim:
    """A request id's slot in each pool of one descriptor."""

    request_id: str
    pools: tuple[Pool, ...]
    descriptor: int  # its index in the request as received


@dataclass(slots=True)  # not frozen: built per request
class Slots:
    """A request split into its slot claims and what the rate limits see."""

    acquire: tuple[Claim, ...]
    release: tuple[Claim, ...]
    rates: Request  # acquire descriptors without the id entry; release descriptors dropped
    positions: tuple[int, ...]  # each rates descriptor's index in the request as received
    # a slot is taken under the id made up for this request (released by negative hits):
    # deciding it again would take a second slot under the same id, which no pool gives
    anonymous: bool = False


def _pools(domain: str, entries: Sequence[tuple[str, str]], match: Match) -> tuple[Pool, ...]:
    trail = match.trail
    paths = key_paths(domain, entries)
    outer = next((i for i, r in enumerate(trail) if r.fair_share is not None), len(trail) - 1)
    anchor = paths[outer]
    pools: list[Pool] = []
    for depth, rule in enumerate(trail[:-1]):
        if rule.fair_share is None or rule.concurrency is None:
            continue
        child = trail[depth + 1].concurrency
        client = entries[depth + 1][1]
        limit = math.inf if child is None else child.max_in_flight
        cap = rule.concurrency
        pools.append(
            Pool(paths[depth] + POOL_SUFFIX, rule, cap.max_in_flight, cap.max_duration, anchor,
                 client, limit, rule.fair_share.weight(client))
        )  # fmt: skip
    own = match.rule.concurrency
    # A cap's pool is its clients' (with who holds what); a descriptor stopping at the cap
    # itself names no client, so it takes no slot there rather than one nobody owns.
    if own is not None and match.rule.fair_share is None:
        pools.append(Pool(paths[-1] + POOL_SUFFIX, match.rule, own.max_in_flight,
                          own.max_duration, anchor))  # fmt: skip
    return tuple(pools)


def declared(config: Config) -> bool:
    """Whether any rule of ``config`` declares concurrency (else ``split`` is never needed)."""
    return any(
        rule.concurrency is not None
        for domain in config.domains.values()
        for rule, _ in walk(domain.rules)
    )


def _by_negative_hits(request: Request, descriptor: Descriptor, matcher: Matcher
                      ) -> tuple[Pool, ...]:  # fmt: skip
    """The pools of a descriptor matched whole onto a rule released by negative hits."""
    match = matcher.match(request.domain, descriptor.entries)
    if match is None or match.rule.concurrency is None:
        return ()
    if match.rule.concurrency.released_by != "negative_hits":
        return ()
    return _pools(request.domain, descriptor.entries, match)


def split(request: Request, matcher: Matcher, anonymous: str = "") -> Slots:
    """``request``'s slot claims, and the request the rate limits are decided on;
    ``anonymous``: the id a slot of a rule released by negative hits is taken under (one
    per request, made up by the caller)."""
    domain = matcher.config.domains.get(request.domain)
    if domain is None:
        return Slots((), (), request, tuple(range(len(request.descriptors))))
    acquire: list[Claim] = []
    release: list[Claim] = []
    kept: list[Descriptor] = []
    positions: list[int] = []
    for index, descriptor in enumerate(request.descriptors):
        entries = descriptor.entries
        key, request_id = entries[-1]
        releasing = key == domain.release_key
        match = None
        if len(entries) > 1 and (releasing or key == domain.acquire_key):
            match = matcher.match(request.domain, entries[:-1])
        pools = _pools(request.domain, entries[:-1], match) if match is not None else ()
        if not pools and (descriptor.negative or anonymous):
            pools = _by_negative_hits(request, descriptor, matcher)
            if pools:
                if descriptor.negative:
                    release.append(Claim(ANY, pools, index))
                else:
                    acquire.append(Claim(anonymous, pools, index))
                    kept.append(descriptor)
                    positions.append(index)
                continue
        if not pools:
            kept.append(descriptor)
            positions.append(index)
            continue
        (release if releasing else acquire).append(Claim(request_id, pools, index))
        if not releasing:
            kept.append(Descriptor(entries[:-1], descriptor.limit, descriptor.hits))
            positions.append(index)
    if not acquire and not release:
        return Slots((), (), request, tuple(positions))
    rates = Request(request.domain, tuple(kept), request.hits)
    made_up = bool(anonymous) and any(c.request_id == anonymous for c in acquire)
    return Slots(tuple(acquire), tuple(release), rates, tuple(positions), made_up)


@dataclass(frozen=True, slots=True)
class CapDemand:
    """One client's state at a cap, as the fair split reads it."""

    held: int
    refused: int  # acquires refused in the last DEMAND_PERIOD
    limit: float
    weight: float


def fair_bound(pool: Pool, clients: Mapping[str, CapDemand]) -> float:
    """The most slots ``pool.client`` may hold at the cap, its acquire included in demand.

    Weighted max-min fairness: λ solves ``sum_i min(d_i, L_i, λ·w_i) = C`` with ``d_i`` the
    slots held plus refused; the client may hold ``min(L, λ·w)``.
    """
    assert pool.client is not None
    own = clients.get(pool.client, CapDemand(0, 0, pool.client_limit, pool.weight))
    others = [c for name, c in clients.items() if name != pool.client]
    demands = [own.held + own.refused + 1.0] + [float(c.held + c.refused) for c in others]
    limits = [pool.client_limit] + [c.limit for c in others]
    weights = [pool.weight] + [c.weight for c in others]
    level = water_level(demands, limits, weights, pool.limit)
    return min(pool.client_limit, level * pool.weight)


def taken(claims: Sequence[Claim]) -> list[tuple[str, Pool]]:
    """Each (request id, pool) the claims touch, once: two descriptors of one request that
    reach the same pool take one slot there."""
    seen: set[tuple[str, str]] = set()
    out: list[tuple[str, Pool]] = []
    for claim in claims:
        for pool in claim.pools:
            if (claim.request_id, pool.key) not in seen:
                seen.add((claim.request_id, pool.key))
                out.append((claim.request_id, pool))
    return out


@dataclass(slots=True)  # not frozen: built per request
class SlotOutcome:
    """What an acquire saw, per (request id, pool) of ``taken``: all taken, or none."""

    admitted: bool
    in_pool: tuple[int, ...]  # slots held in the pool before this call (expired ones gone)
    expired: tuple[int, ...]  # slots this call found expired and gave back


def may_take(pool: Pool, in_pool: int, held: int, bound: float) -> bool:
    """Whether one more slot fits: the pool's max and, at a cap, the client's fair bound."""
    if in_pool + 1 > pool.limit:
        return False
    return pool.client is None or held + 1 <= bound + _EPSILON


# --- the sum rule for concurrency caps ------------------------------------------------------

GLOBAL_POOL_MESSAGE = (
    "global concurrency pool only: one client can hold every slot (hint: add fair_share "
    "over per-client children)"
)


def _slots(n: float) -> str:
    return "unlimited" if math.isinf(n) else str(int(n))


def _required(cap: Rule, active: int) -> tuple[float, str]:
    """Slots the cap must hold for ``active`` clients at their own max, and how it adds up."""

    def own(rule: Rule) -> float:
        return math.inf if rule.concurrency is None else float(rule.concurrency.max_in_flight)

    named = sorted((own(c) for c in cap.children if c.is_fixed), reverse=True)
    open_max = max((own(c) for c in cap.children if not c.is_fixed), default=None)
    if active <= len(named):
        return sum(named[:active]), f"largest {active} of {len(named)} named clients"
    if open_max is None:
        return sum(named), f"{len(named)} named clients"
    others = active - len(named)
    total = sum(named) + open_max * others
    if not named:
        return total, f"{_slots(open_max)} x {active} active clients"
    return total, (
        f"{len(named)} named clients {_slots(sum(named))} + {_slots(open_max)} x {others} "
        "other active clients"
    )


def classify_cap(domain: Domain, cap: Rule) -> Classification:
    """The verdict on one cap's global ``max_in_flight`` against its clients' own."""
    assert cap.fair_share is not None and cap.concurrency is not None
    active = cap.fair_share.active_clients
    capacity = cap.concurrency.max_in_flight
    required, how = _required(cap, active)
    figures = (
        f"global max_in_flight {capacity} %s sum of per-client max_in_flight "
        f"{_slots(required)} ({how})"
    )
    if capacity >= required:
        mode, message = Mode.PER_CLIENT_BUCKETS, "per-client-buckets: " + figures % ">="
    else:
        mode = Mode.WEIGHTED_FAIR_QUEUE
        message = figures % "<" + ": contention shifts to the cap"
    # No per-client figure: each client's slots are its own max_in_flight, named in the
    # message, and no report of a concurrency cap shows one.
    return Classification(domain.source, cap.path, mode, message, float(capacity), required,
                          active_clients=active)  # fmt: skip


def _classify_domain(domain: Domain) -> Iterator[Classification]:
    for rule, ancestors in walk(domain.rules):
        if rule.concurrency is None:
            continue
        if rule.fair_share is not None:
            yield classify_cap(domain, rule)
        elif not any(a.fair_share is not None for a in ancestors) and all(
            r.is_fixed for r in (*ancestors, rule)
        ):
            most = float(rule.concurrency.max_in_flight)
            yield Classification(
                domain.source, rule.path, Mode.GLOBAL_BUCKET_ONLY, GLOBAL_POOL_MESSAGE, most
            )


def classify(config: Config) -> list[Classification]:
    """Every concurrency cap and global-only pool of ``config``, in file and tree order."""
    out: list[Classification] = []
    for name in sorted(config.domains):
        out.extend(_classify_domain(config.domains[name]))
    return out
