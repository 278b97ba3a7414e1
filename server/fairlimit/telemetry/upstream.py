"""envoyproxy/ratelimit's metrics, under the names its default Prometheus mapping gives them.

Dashboards and alerts built on upstream query ``ratelimit_service_rate_limit_total_hits``
(no ``_total``: upstream's statsd exporter does not add one) with the labels ``domain``,
``key1`` and ``key2``. The OpenTelemetry Prometheus exporter appends ``_total`` to every
counter, and OpenMetrics requires it, so these series are rendered here as Prometheus text
0.0.4, the format upstream serves. Counting follows upstream: of a request that takes a rule
past its limit, only the hits beyond the limit are ``over_limit`` and the hits between the
near-limit threshold and the limit are ``near_limit``.
"""

import math
import threading
from collections.abc import Iterable, Mapping

from fairlimit.core.admission import Code, Status
from fairlimit.core.upstream import labels

_RULE_STATS = ("near_limit", "over_limit", "total_hits", "within_limit", "shadow_mode")
_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0)  # Prometheus' default
_PREFIX = "ratelimit_service_"


def rule_counts(status: Status, hits: int, near_ratio: float) -> dict[str, int]:
    """What upstream counts for ``hits`` on a rule answered with ``status``."""
    limit = status.current_limit
    if limit is None or hits == 0:
        return {}
    cap = limit.requests_per_unit
    near = math.floor(cap * near_ratio)
    counts = {"total_hits": hits}
    if status.code is Code.OVER_LIMIT or status.shadowed:
        before = cap - status.limit_remaining  # nothing was charged: the counter as it stands
        after = before + hits
        over = hits if before >= cap else after - cap
        counts["over_limit"] = over
        if before < cap:
            counts["near_limit"] = cap - max(near, before)
        if status.shadowed:
            counts["shadow_mode"] = over
        return counts
    after = cap - status.limit_remaining
    before = after - hits
    counts["within_limit"] = hits
    if after > near:
        counts["near_limit"] = hits if before >= near else after - near
    return counts


class UpstreamStats:
    """The counts behind the upstream names, added to per request and rendered on scrape."""

    def __init__(self, near_ratio: float = 0.8) -> None:
        self.near_ratio = near_ratio
        self._lock = threading.Lock()  # the gRPC loop adds, a scrape thread may render
        self._rules: dict[tuple[str, str], int] = {}  # (stat, stat key) -> hits
        self._service: dict[str, int] = {"config_load_success": 0, "config_load_error": 0}
        self._errors: dict[str, int] = {}
        self._requests = 0
        self._latency = [0] * (len(_BUCKETS) + 1)
        self._latency_sum = 0.0

    def rule(self, key: str, status: Status, hits: int) -> None:
        counts = rule_counts(status, hits, self.near_ratio)
        with self._lock:
            for stat, amount in counts.items():
                self._rules[(stat, key)] = self._rules.get((stat, key), 0) + amount

    def config_load(self, ok: bool) -> None:
        name = "config_load_success" if ok else "config_load_error"
        with self._lock:
            self._service[name] += 1

    def error(self, kind: str) -> None:
        """One failed call: ``redis_error`` (backend) or ``service_error`` (bad request)."""
        with self._lock:
            self._errors[kind] = self._errors.get(kind, 0) + 1

    def call(self, seconds: float) -> None:
        """One ShouldRateLimit call that took ``seconds``."""
        at = next((i for i, bound in enumerate(_BUCKETS) if seconds <= bound), len(_BUCKETS))
        with self._lock:
            self._requests += 1
            self._latency[at] += 1
            self._latency_sum += seconds

    def render(self) -> str:
        """Prometheus text 0.0.4 of every upstream-named series."""
        with self._lock:
            rules, service = dict(self._rules), dict(self._service)
            errors, requests = dict(self._errors), self._requests
            latency, total = list(self._latency), self._latency_sum
        lines: list[str] = []
        for stat in _RULE_STATS:
            series = [(labels(key), n) for (s, key), n in sorted(rules.items()) if s == stat]
            _family(lines, f"{_PREFIX}rate_limit_{stat}", "counter", series)
        _family(lines, f"{_PREFIX}should_rate_limit_error", "counter",
                [({"err_type": k}, n) for k, n in sorted(errors.items())])  # fmt: skip
        method = {"grpc_method": "ShouldRateLimit"}
        _family(lines, f"{_PREFIX}total_requests", "counter", [(method, requests)])
        _histogram(lines, f"{_PREFIX}response_time_seconds", method, latency, total)
        for name, n in service.items():
            _family(lines, f"{_PREFIX}{name}", "counter", [({}, n)])
        return "".join(lines)


def _text(labels_: Mapping[str, str]) -> str:
    if not labels_:
        return ""
    escaped = (
        (k, v.replace("\\", "\\\\").replace("\n", "\\n").replace('"', '\\"'))
        for k, v in labels_.items()
    )
    return "{" + ",".join(f'{k}="{v}"' for k, v in escaped) + "}"


def _family(
    lines: list[str], name: str, kind: str, series: Iterable[tuple[Mapping[str, str], float]]
) -> None:
    rows = list(series)
    if not rows:
        return
    lines.append(f"# TYPE {name} {kind}\n")
    lines.extend(f"{name}{_text(labels_)} {value}\n" for labels_, value in rows)


def _histogram(
    lines: list[str], name: str, base: Mapping[str, str], counts: list[int], total: float
) -> None:
    lines.append(f"# TYPE {name} histogram\n")
    running = 0
    for bound, n in zip([*map(str, _BUCKETS), "+Inf"], counts, strict=True):
        running += n
        lines.append(f"{name}_bucket{_text({**base, 'le': bound})} {running}\n")
    lines.append(f"{name}_sum{_text(base)} {total}\n")
    lines.append(f"{name}_count{_text(base)} {running}\n")
