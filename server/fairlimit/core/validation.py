"""The sum-of-limits rule and the classification of every cap and shared bucket.

For a ``fair_share`` cap: ``required = sum of the explicitly-valued children's limits + (active
- explicit children) x the value-less child's limit``, each child's limit being the most its
own limits admit in one of the cap's windows (a daily quota under a per-second cap counts
whole: it may be spent in one second), per second. ``cap >= required`` is
per-client-buckets, ``cap < required`` is weighted-fair-queue (a warning). A limited node
outside any cap whose path has only fixed values is global-bucket-only (a note). A limited
node outside any cap with a value-less or wildcard level keeps a bucket per client: ``check``
lists those too (``per_client_rules``), so that it counts every limit it read.
"""

import math
from collections.abc import Iterator, Sequence
from dataclasses import dataclass

# The verdicts this module works out, named here for its callers; defined apart so that a
# loaded config (core/rules.py) holds them without importing this module.
from fairlimit.core.classification import Classification as Classification
from fairlimit.core.classification import Mode as Mode
from fairlimit.core.describe import duration_text, limit_words
from fairlimit.core.rules import Config, Domain, RateLimit, Rule, most_within, walk


def rate(per_second: float) -> str:
    """A rate for messages: ``1000/s``, ``1.667/s``, ``unlimited``."""
    if math.isinf(per_second):
        return "unlimited"
    text = f"{per_second:.3f}".rstrip("0").rstrip(".")
    return f"{text}/s"


def _most_per_second(rule: Rule, window: int) -> float:
    """A client's rate under a cap whose window is ``window`` s: the most its own limits
    admit in one such window, per second (inf: none, or unlimited). A limit of a longer
    window counts whole, as a client may spend it in one of the cap's windows."""
    return most_within(rule.limits, window) / window


def _spent_at_once(rule: Rule, window: int) -> RateLimit | None:
    """The limit of ``rule`` that sets its most in a window of ``window`` s when that limit's
    own window is longer (a daily quota under a per-second cap), else None."""
    most = most_within(rule.limits, window)
    for limit in rule.limits:
        if not limit.unlimited and limit.window > window and most_within((limit,), window) == most:
            return limit
    return None


@dataclass(frozen=True, slots=True)
class _Sum:
    required: float
    per_client: float | None
    explanation: str


def _required(cap: Rule, active: int, window: int) -> _Sum:
    named_children = [c for c in cap.children if c.is_fixed]
    explicit = sorted((_most_per_second(c, window) for c in named_children), reverse=True)
    open_children = [c for c in cap.children if not c.is_fixed]
    per_client = max((_most_per_second(c, window) for c in open_children), default=None)
    if active <= len(explicit):
        total = sum(explicit[:active])
        return _Sum(total, per_client, f"largest {active} of {len(explicit)} named clients")
    others = active - len(explicit)
    if per_client is None:
        return _Sum(sum(explicit), None, f"{len(explicit)} named clients")
    # Limits are never negative (the loader takes 0..2**32-1), so a zero limit adds 0.0 as is.
    open_part = per_client * others
    if not explicit:
        return _Sum(open_part, per_client, f"{rate(per_client)} x {active} active clients")
    named = f"{len(explicit)} named clients {rate(sum(explicit))}"
    return _Sum(
        sum(explicit) + open_part,
        per_client,
        f"{named} + {rate(per_client)} x {others} other active clients",
    )


def _at_once(cap: Rule, window: int) -> str:
    """What a client limit of a longer window than the cap's means for the sum, in words
    (the value-less child's first, then the named ones'), or ``""``."""
    children = sorted(cap.children, key=lambda c: c.is_fixed)
    for child in children:
        limit = _spent_at_once(child, window)
        if limit is not None:
            return (
                f"; a client may spend its {limit_words(limit)} in one {duration_text(window)}"
                f" window of the cap, {rate(limit.per_second)} on average"
            )
    return ""


def classify_cap(domain: Domain, cap: Rule, index: int = 0) -> Classification:
    """The classification of one ``fair_share`` cap, by its limit ``index`` (named in the
    message when the cap has several)."""
    assert cap.fair_share is not None and cap.rate_limit is not None
    active = cap.fair_share.active_clients
    cap_rate = cap.limits[index].per_second
    window = cap.limits[index].window
    needed = _required(cap, active, window)
    named = f"rate_limits[{index}]: " if len(cap.limits) > 1 else ""
    figures = (
        f"global cap {rate(cap_rate)} %s sum of per-client limits "
        f"{rate(needed.required)} ({needed.explanation}{_at_once(cap, window)})"
    )
    if cap_rate >= needed.required:
        mode = Mode.PER_CLIENT_BUCKETS
        message = "per-client-buckets: " + figures % ">="
    else:
        mode = Mode.WEIGHTED_FAIR_QUEUE
        message = figures % "<" + ": contention shifts to the cap"
    return Classification(
        domain.source,
        cap.path,
        mode,
        named + message,
        cap_rate,
        needed.required,
        needed.per_client,
        active,
        index,
    )


GLOBAL_BUCKET_MESSAGE = (
    "global bucket only: allocation is arrival-order dependent; one client can starve the "
    "rest (hint: add fair_share over per-client children)"
)


def _classify_domain(domain: Domain) -> Iterator[Classification]:
    for rule, ancestors in walk(domain.rules):
        if rule.fair_share is not None and rule.rate_limit is not None:
            for index in range(len(rule.limits)):
                yield classify_cap(domain, rule, index)
            continue
        limit = rule.rate_limit
        if limit is None or limit.unlimited:
            continue
        under_cap = any(a.fair_share is not None for a in ancestors)
        fixed_path = rule.is_fixed and all(a.is_fixed for a in ancestors)
        if fixed_path and not under_cap:
            yield Classification(
                domain.source,
                rule.path,
                Mode.GLOBAL_BUCKET_ONLY,
                GLOBAL_BUCKET_MESSAGE,
                limit.per_second,
            )


PER_CLIENT_MESSAGE = "per-client buckets: each client has its own limits, under no shared cap"


def _per_value(rule: Rule) -> bool:
    """True when the node counts each value apart: value-less, or a wildcard whose values
    do not share one counter (``share_threshold``)."""
    return rule.value is None or (rule.is_wildcard and not rule.share_threshold)


def uncapped_rules(config: Config) -> list[Classification]:
    """Every limited rule outside any cap that ``classify`` leaves out, in file and tree
    order: one with a bucket per client (a value-less or wildcard level on its path) is
    per-client buckets; one whose only open levels are ``share_threshold`` wildcards shares
    one counter, a global bucket. Not verdicts the server keeps: ``check`` counts and lists
    them, so that no limit it read goes unmentioned."""
    out: list[Classification] = []
    for name in sorted(config.domains):
        domain = config.domains[name]
        for rule, ancestors in walk(domain.rules):
            if not rule.limits or rule.limits[0].unlimited or rule.fair_share is not None:
                continue
            if any(a.fair_share is not None for a in ancestors):
                continue  # counted in its cap's verdict
            if rule.is_fixed and all(a.is_fixed for a in ancestors):
                continue  # a global bucket: classify's
            per_client = any(_per_value(r) for r in (*ancestors, rule))
            tightest = min(limit.per_second for limit in rule.limits)  # no cap's window here
            mode = Mode.PER_CLIENT_BUCKETS if per_client else Mode.GLOBAL_BUCKET_ONLY
            message = PER_CLIENT_MESSAGE if per_client else GLOBAL_BUCKET_MESSAGE
            out.append(
                Classification(
                    domain.source,
                    rule.path,
                    mode,
                    message,
                    rule.limits[0].per_second,
                    per_client_per_second=tightest if per_client else None,
                )
            )
    return out


def most_severe(classes: Sequence[Classification]) -> Classification:
    """One verdict for a rule classified once per limit, as a view shows it beside the
    rule: a warning wins (one contended limit makes the cap share fairly), else the first."""
    return next((c for c in classes if c.is_warning), classes[0])


def classify(config: Config) -> list[Classification]:
    """Every cap and every global-only bucket of ``config``, in file and tree order."""
    out: list[Classification] = []
    for name in sorted(config.domains):
        out.extend(_classify_domain(config.domains[name]))
    return out
