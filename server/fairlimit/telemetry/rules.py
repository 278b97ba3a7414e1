"""The per-rule hit counters, with envoyproxy/ratelimit's meanings, in hits.

``ratelimit.hits`` (upstream's total_hits; Prometheus adds ``_total``), ``.over_limit``
(shadow-mode overs included), ``.near_limit`` (admitted hits that took the rule past the
near-limit ratio, 80% unless set, of its current limit), ``.within_limit``, ``.shadow_mode``;
attributes ``domain`` and ``rule`` (the rule path), and ``value`` (the request's
``key=value`` path) only where the rule sets ``detailed_metric``. Also: what upstream's own
names count per rule (``count_upstream``, for ``telemetry.upstream``).
"""

import math
from collections.abc import Iterable, Sequence

from opentelemetry.metrics import CallbackOptions, Meter, Observation

from fairlimit.core.admission import Code, Status
from fairlimit.core.plan import Plan
from fairlimit.core.request import Descriptor, Request
from fairlimit.core.rules import Rule
from fairlimit.core.upstream import override_key, stat_key
from fairlimit.telemetry.upstream import UpstreamStats

RULE_COUNTERS = (
    ("hits", "Hits checked against the rule (upstream's total_hits)"),
    ("over_limit", "Hits over the rule's limit (shadow-mode overs included)"),
    ("near_limit", "Admitted hits that took the rule past 80% of its current limit"),
    ("within_limit", "Hits within the rule's limit"),
    ("shadow_mode", "Hits over a shadow-mode rule's limit, answered OK"),
)

Key = tuple[tuple[str, str], ...]  # a series' attributes, in order, as dict items


class Tally:
    """A monotonic counter summed in a dict and reported when a reader collects.

    Recording is one dict update; the SDK's synchronous ``Counter.add`` costs about 15 µs
    (attribute hashing, locks, aggregation) and a request records two or three of them.
    The collecting thread copies the dict in one C call, so it never sees it change size.
    """

    __slots__ = ("_totals",)

    def __init__(self) -> None:
        self._totals: dict[Key, int] = {}

    def add(self, amount: int, key: Key) -> None:
        """Add ``amount`` to the series of attributes ``dict(key)``."""
        self._totals[key] = self._totals.get(key, 0) + amount

    def observe(self, options: CallbackOptions) -> Iterable[Observation]:
        return [Observation(total, dict(key)) for key, total in list(self._totals.items())]


class RuleCounters:
    """The ``ratelimit.*`` observable counters and the tallies they report."""

    def __init__(self, meter: Meter) -> None:
        self.tallies: dict[str, Tally] = {}
        # (domain, rule path) -> the attributes of its series: built once, not per request
        self._keys: dict[tuple[str, str], Key] = {}
        for name, text in RULE_COUNTERS:
            self.tallies[name] = Tally()
            meter.create_observable_counter(
                f"ratelimit.{name}", [self.tallies[name].observe], "{hit}", text
            )

    def forget_rules(self) -> None:
        """Drop the series attributes made so far: the rules of the configuration before
        may be gone."""
        self._keys = {}

    def count(self, request: Request, statuses: Sequence[Status], near_limit_ratio: float) -> None:
        """Count one answered request per rule it was checked against."""
        domain = request.domain
        for descriptor, status in zip(request.descriptors, statuses, strict=True):
            rule, limit = status.rule, status.current_limit
            hits = request.hits_for(descriptor)
            if rule is None or limit is None or hits == 0:
                continue
            key = self.series(domain, descriptor, rule)
            over = status.code is Code.OVER_LIMIT
            self.add(key, hits, over, status.shadowed, limit.requests_per_unit,
                     status.limit_remaining, near_limit_ratio)  # fmt: skip

    def add(
        self,
        key: Key,
        hits: int,
        over: bool,
        shadowed: bool,
        per_unit: int,
        remaining: int,
        near_limit_ratio: float,
    ) -> None:
        """Count one descriptor's ``hits`` in the series ``key``: refused (``over``), or
        over a shadow-mode limit; else within its limit of ``per_unit`` with ``remaining``
        left after it, and near the limit for the hits past the ratio."""
        tallies = self.tallies
        tallies["hits"].add(hits, key)
        if over or shadowed:
            tallies["over_limit"].add(hits, key)
            if shadowed:
                tallies["shadow_mode"].add(hits, key)
            return
        tallies["within_limit"].add(hits, key)
        near = per_unit - remaining - math.floor(per_unit * near_limit_ratio)
        if near > 0:
            tallies["near_limit"].add(min(hits, near), key)

    def series(self, domain: str, descriptor: Descriptor, rule: Rule) -> Key:
        """The attributes of the series a descriptor matching ``rule`` counts in: ``domain``
        and ``rule``, and its ``value`` path where the rule sets ``detailed_metric``."""
        if rule.detailed_metric:
            value = "/".join(f"{k}={v}" for k, v in descriptor.entries)
            return (("domain", domain), ("rule", rule.path), ("value", value))
        return self._keys.get((domain, rule.path)) or self._key(domain, rule.path)

    def _key(self, domain: str, path: str) -> Key:
        """The attributes of a rule's series (``domain``, ``rule``), made once per rule."""
        key = self._keys.get((domain, path))
        if key is None:
            key = self._keys[domain, path] = (("domain", domain), ("rule", path))
        return key


def count_upstream(
    upstream: UpstreamStats, request: Request, statuses: Sequence[Status], plan: Plan
) -> None:
    """Count one answered request under upstream's stat keys (one per limited descriptor)."""
    for descriptor, status, dplan in zip(
        request.descriptors, statuses, plan.descriptors, strict=True
    ):
        if status.current_limit is None or dplan.unlimited:
            continue
        if descriptor.limit is not None or dplan.match is None:
            key = override_key(request.domain, descriptor.entries)
        else:
            key = stat_key(request.domain, descriptor.entries, dplan.match.trail)
        upstream.rule(key, status, request.hits_for(descriptor))
