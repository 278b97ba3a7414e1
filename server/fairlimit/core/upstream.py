"""envoyproxy/ratelimit's names for a matched rule: its stat key and Prometheus labels.

Upstream names a rule's counters ``ratelimit.service.rate_limit.<KEY>.<stat>``, where KEY is
the config path ``domain.key_value.key`` (a value-less level is its key alone, a wildcard
level its pattern). ``value_to_metric`` on a value-less or wildcard level puts the request's
value there instead; ``detailed_metric`` on the matched rule names the request's whole path;
a ``share_threshold`` level always shows its pattern, since all its values share a counter.
Its default Prometheus mapping turns KEY into the labels ``domain``, ``key1`` and, for two or
more levels, ``key2`` (deeper levels are dropped).
"""

import re
from collections.abc import Sequence

from fairlimit.core.matching import Entry
from fairlimit.core.rules import Rule

_IPV4 = re.compile(r"\d{1,3}\.\d{1,3}\.\d{1,3}\.\d{1,3}")


def _part(key: str, value: str | None) -> str:
    return f"{key}_{value}" if value else key


def _level(node: Rule, entry: Entry, detailed: bool) -> str:
    key, value = entry
    if node.share_threshold and node.is_wildcard:
        return _part(key, node.value)
    if detailed:
        return _part(key, value)
    if node.value is None:
        return _part(key, value if node.value_to_metric else None)
    if node.is_wildcard and node.value_to_metric:
        return _part(key, value)
    return _part(key, node.value)


def stat_key(domain: str, entries: Sequence[Entry], trail: Sequence[Rule]) -> str:
    """The key upstream counts ``entries``, matched along ``trail``, under (sanitised)."""
    detailed = trail[-1].detailed_metric
    parts = [domain, *(_level(n, e, detailed) for n, e in zip(trail, entries, strict=False))]
    return sanitize(".".join(parts))


def override_key(domain: str, entries: Sequence[Entry]) -> str:
    """The key of a request-supplied limit: the request's own path."""
    return sanitize(".".join([domain, *(_part(k, v) for k, v in entries)]))


def sanitize(name: str) -> str:
    """Upstream's stat-name clean-up: ``:`` and ``|`` become ``_``, as do IPv4 dots."""
    cleaned = name.replace(":", "_").replace("|", "_")
    return _IPV4.sub(lambda m: m.group(0).replace(".", "_"), cleaned)


def labels(key: str) -> dict[str, str]:
    """The labels upstream's default Prometheus mapping gives the stat key ``key``."""
    parts = key.split(".")
    names = ("domain", "key1") if len(parts) <= 2 else ("domain", "key1", "key2")
    return {name: parts[i] if i < len(parts) else "" for i, name in enumerate(names)}
