"""The frozen model of a loaded descriptor configuration."""

import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import PurePath
from types import MappingProxyType

from fairlimit.core.classification import Classification
from fairlimit.core.units import Algorithm, Shape, Unit


@dataclass(frozen=True, slots=True)
class RateLimit:
    """``requests_per_unit`` hits per window (or unlimited): ``unit``'s, or ``seconds`` long
    when given (a multiple of a unit or a duration; ``unit`` is then the longest unit within
    it, for Envoy's enum). ``shape``: a calendar window or a smooth algorithm (None:
    upstream's fixed window).

    ``window`` (seconds) and ``per_second`` are derived once here: every request reads them,
    and an enum's ``value`` is a descriptor lookup each time.
    """

    requests_per_unit: int
    unit: Unit
    unlimited: bool = False
    name: str | None = None
    replaces: tuple[str, ...] = ()
    # Usage reported after the response (Envoy's apply_on_stream_done): a charge is recorded
    # on every level it touches even when the answer is OVER_LIMIT (DESIGN section 4).
    # None: the rule does not say, and the config's ``charge_over_limit`` decides.
    charge_when_over_limit: bool | None = None
    seconds: int = 0  # 0: the unit's length
    shape: Shape | None = None
    window: int = field(init=False, repr=False, compare=False)
    per_second: float = field(init=False, repr=False, compare=False)

    def __post_init__(self) -> None:
        window = self.seconds or self.unit.seconds
        object.__setattr__(self, "window", window)
        object.__setattr__(self, "per_second", self.requests_per_unit / window)

    @property
    def algorithm(self) -> Algorithm:
        return Algorithm.FIXED if self.shape is None else self.shape.algorithm


# The shortest a calendar window of each unit can be, as a part of its nominal length: a
# day of 23 hours, a week one hour short, a February (a year of 365 days is nominal).
_CALENDAR_SHORTEST = 0.9


def most_within(limits: Sequence[RateLimit], window: int) -> float:
    """The most hits ``limits`` together admit one client in a fixed epoch-aligned window of
    ``window`` seconds (a cap's): the least of each limit's most (inf: none, or unlimited).

    A limit of a longer window may be spent whole in one of the cap's windows (1000/hour
    is up to 1000 in one second), not its average rate (0.278 in a second, which is no
    request at all): each limit holds in its own window, the cap shares its own.
    """
    if not limits or limits[0].unlimited:
        return math.inf
    if len(limits) == 1:  # most (a status asks this per request): no generator
        return _most_within(limits[0], window)
    return min(_most_within(limit, window) for limit in limits)


def _most_within(limit: RateLimit, window: int) -> float:
    """The most ``limit`` admits in an epoch-aligned window of ``window`` seconds: its
    count times the number of its own windows that one can meet."""
    count, own = limit.requests_per_unit, limit.window
    shape = limit.shape
    if shape is not None and shape.algorithm is Algorithm.GCRA:
        # burst + 1 at once, then one every own / count seconds
        return shape.burst + math.ceil(count * window / own)
    if shape is not None and shape.algorithm is Algorithm.SLIDING:
        return count * math.ceil(window / own)  # no span of its window passes the count
    if shape is not None and shape.calendar is not None:
        if own > window and 900 % window == 0:  # civil midnights fall on quarter hours
            return count
        return count * (1 + math.ceil(window / (own * _CALENDAR_SHORTEST)))
    # epoch-aligned windows of both lengths: a window of ``window`` starts at a multiple
    # of their gcd into one of ``own``, and meets 1 + ceil((window - gcd) / own) of them
    return count * (1 + math.ceil((window - math.gcd(window, own)) / own))


@dataclass(frozen=True, slots=True)
class FairShare:
    """A cap's declaration: how many clients it must hold, and their weights."""

    active_clients: int
    weights: Mapping[str, float] = field(default_factory=lambda: MappingProxyType({}))

    def weight(self, client: str) -> float:
        """The weight of ``client`` at this cap (1 unless declared)."""
        return self.weights.get(client, 1.0)


@dataclass(frozen=True, slots=True)
class Concurrency:
    """At most ``max_in_flight`` requests in flight; a slot expires ``max_duration`` s after it
    was taken (so that slots a crashed proxy never released come back)."""

    max_in_flight: int
    max_duration: float = 300.0
    # "negative_hits": a slot is taken by a descriptor without a request id and given back
    # by the client's next stream-done descriptor with is_negative_hits (core/concurrency)
    released_by: str = "request_id"


@dataclass(frozen=True, slots=True)
class Reservation:
    """Reserve an estimate of a request's hits on the request path, settled at stream end
    (docs/tokens.md): ``default`` is the estimate when the descriptor carries none (None:
    the client's recent average, else 1); a reservation not settled within
    ``max_duration`` seconds stays charged as it was."""

    default: int | None = None
    max_duration: float = 300.0


# The descriptor entry keys that carry Envoy's request id: an entry with ACQUIRE_KEY ends a
# request-path descriptor that takes slots, one with RELEASE_KEY ends the stream-done
# descriptor that gives them back (docs/concurrency.md).
ACQUIRE_KEY = "request_id"
RELEASE_KEY = "request_done"


@dataclass(frozen=True, slots=True)
class Rule:
    """One descriptor node: ``key`` with an exact, wildcard or absent ``value``."""

    key: str
    value: str | None
    path: str
    source: str
    rate_limit: RateLimit | None = None  # the first of ``limits`` (RLQS uses it alone)
    shadow_mode: bool = False
    detailed_metric: bool = False
    fair_share: FairShare | None = None
    children: tuple["Rule", ...] = ()
    concurrency: Concurrency | None = None
    reservation: Reservation | None = None  # token budgets (core/reserve.py)
    # envoyproxy/ratelimit's keys, with its meanings: fail only when every quota descriptor
    # of a request is over; the request's value in the upstream metric key; every value of
    # this wildcard shares one counter; returned as response dynamic metadata (never mutated).
    quota_mode: bool = False
    value_to_metric: bool = False
    share_threshold: bool = False
    metadata: Mapping[str, object] | None = None
    # fairlimit's: the quota descriptors of one group pass when any of them passes, and
    # every group must pass (None: the implicit group of upstream's quota_mode)
    quota_group: str | None = None
    more_limits: tuple[RateLimit, ...] = ()  # the rest of ``rate_limits``, after rate_limit

    @property
    def limits(self) -> tuple[RateLimit, ...]:
        """Every limit of the node (``rate_limit``, or each of ``rate_limits``)."""
        if self.rate_limit is None:
            return ()
        return (self.rate_limit, *self.more_limits)

    @property
    def is_wildcard(self) -> bool:
        return self.value is not None and "*" in self.value

    @property
    def is_fixed(self) -> bool:
        """True when the node names one exact value (no wildcard, not value-less)."""
        return self.value is not None and not self.is_wildcard


@dataclass(frozen=True, slots=True)
class Domain:
    """All descriptor rules of one domain, loaded from one file."""

    name: str
    source: str
    rules: tuple[Rule, ...]
    acquire_key: str = ACQUIRE_KEY
    release_key: str = RELEASE_KEY


@dataclass(frozen=True, slots=True)
class Config:
    """A whole loaded configuration: domains by name."""

    domains: Mapping[str, Domain]
    # What a limit that does not say ``charge_when_over_limit`` does: False, a refused
    # request consumes nothing (fairlimit's own); True, every hit counts, refused or not
    # (envoyproxy/ratelimit's, for configs that cannot say: xDS, upstream's environment).
    charge_over_limit: bool = False

    @classmethod
    def of(cls, domains: list[Domain], charge_over_limit: bool = False) -> "Config":
        return cls(MappingProxyType({d.name: d for d in domains}), charge_over_limit)

    def rules_by_path(self) -> dict[str, Rule]:
        """Every rule of every domain by its path (a path starts with its domain's name)."""
        return {r.path: r for d in self.domains.values() for r, _ in walk(d.rules)}


@dataclass(frozen=True, slots=True)
class Loaded:
    """A loaded configuration with its classification and the files it came from."""

    config: Config
    classifications: tuple[Classification, ...]
    files: tuple[PurePath, ...]
    # the concurrency caps' classifications (core/concurrency.py), kept apart from the rate
    # caps' because a node can be both and each has its own verdict
    concurrency: tuple[Classification, ...] = ()

    @property
    def warnings(self) -> list[str]:
        return [c.line for c in (*self.classifications, *self.concurrency) if c.is_warning]

    @property
    def notes(self) -> list[str]:
        """Advice that is never an error (global buckets, as upstream has them)."""
        return [c.line for c in (*self.classifications, *self.concurrency) if c.is_note]

    def verdicts_by_path(self) -> dict[str, list[Classification]]:
        """The rate classifications of each classified rule, in order (a cap has one per
        limit, ``Classification.limit`` says which)."""
        out: dict[str, list[Classification]] = {}
        for c in self.classifications:
            out.setdefault(c.path, []).append(c)
        return out


def walk(rules: tuple[Rule, ...]) -> list[tuple[Rule, tuple[Rule, ...]]]:
    """Every rule below ``rules`` with its ancestors (outermost first), depth first."""
    out: list[tuple[Rule, tuple[Rule, ...]]] = []
    stack: list[tuple[Rule, tuple[Rule, ...]]] = [(r, ()) for r in reversed(rules)]
    while stack:
        rule, ancestors = stack.pop()
        out.append((rule, ancestors))
        stack.extend((c, (*ancestors, rule)) for c in reversed(rule.children))
    return out
