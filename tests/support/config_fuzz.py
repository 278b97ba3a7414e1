"""Seeded random descriptor configs and hostile RateLimitRequests for them (issue 41).

``draw_config`` draws the config language's features together: units second to year,
multipliers, durations, calendars, sliding and GCRA (with bursts), several limits on a rule,
``unlimited``, ``name``/``replaces``, ``charge_when_over_limit``, ``fair_share`` caps with
weights and nesting, ``concurrency`` (both ways of release), ``reservation``, ``shadow_mode``,
``quota_mode`` and groups, ``share_threshold``, ``metadata``, ``request_id_keys``; limits of
0 and of 4294967295. Some draws break a rule of the loader, which refuses them: the caller
keeps those ``load`` accepts. ``draw_request`` sends descriptors that follow the config's
paths or stray from it, with hits_addends from 0 to 2^64-1, limit overrides of every unit
number (UNKNOWN and numbers Envoy has not defined among them) and 0 to 4294967295, empty,
long, NUL and non-ASCII keys and values, repeated descriptors and entries, request ids and
stream-done keys for concurrency and token budgets (right and wrong ids), negative hits.
"""

import random
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import yaml

from fairlimit._proto.envoy.extensions.common.ratelimit.v3 import ratelimit_pb2
from fairlimit._proto.envoy.service.ratelimit.v3 import rls_pb2
from fairlimit.config.loader import load
from fairlimit.core.rules import Loaded
from fairlimit.errors import ConfigError

D = ratelimit_pb2.RateLimitDescriptor
KEYS = ["a", "b", "client", "route", "tenant"]
VALUES = ["x", "y", "ü", "x*", "*", "v1", "*y", "010"]
UNITS = ["second", "minute", "hour", "day", "week", "month", "year"]
COUNTS = [0, 1, 1, 2, 3, 5, 10, 1000, 4294967295]
ODD_TEXTS = ["", "x", "ü", "\x00", "a" * 300, "é" * 50, "=", "/", "#", "*", "q", "c0"]
HITS = [0, 1, 2, 1000, 10**9, 4294967295, 2**32, 2**63, 2**64 - 1]
ID_KEYS = ["request_id", "request_done"]


def _limit(r: random.Random, cap: bool, several: bool) -> dict[str, Any]:
    if not several and not cap and r.random() < 0.07:
        return {"unlimited": True}
    out: dict[str, Any] = {}
    style = r.choice(["unit", "unit", "multiplier", "duration"] + ([] if cap else ["calendar"]))
    if style == "unit":
        out["unit"] = r.choice(UNITS)
    elif style == "multiplier":
        out["unit"], out["multiplier"] = r.choice(UNITS), r.choice([2, 5, 1000000])
    elif style == "duration":
        out["duration"] = r.choice(["1s", "7s", "5m", "2h", "7d", "3660d"])
    else:
        out["unit"] = r.choice(["day", "week", "month", "year"])
        out["calendar"] = r.choice(["UTC", "Europe/Berlin", "Pacific/Kiritimati"])
    out["requests_per_unit"] = r.choice(COUNTS)
    if not cap and style != "calendar" and r.random() < 0.4:
        out["algorithm"] = r.choice(["sliding", "gcra"])
        if out["algorithm"] == "gcra":
            out["requests_per_unit"] = max(1, out["requests_per_unit"])
            if r.random() < 0.6:
                out["burst"] = r.choice([0, 1, 4, 4294967295])
    if r.random() < 0.2:
        out["name"] = r.choice(["n1", "n2"])
    if not several and r.random() < 0.15:
        out["replaces"] = [{"name": r.choice(["n1", "n2", "zz"])}]
    if r.random() < 0.2:
        out["charge_when_over_limit"] = r.random() < 0.7
    return out


def _fixed(limit: dict[str, Any] | None) -> bool:
    """A limit a reservation may settle: one fixed window (the loader refuses the rest)."""
    return limit is not None and not ({"algorithm", "calendar", "unlimited"} & set(limit))


def _node(r: random.Random, depth: int, under_cap: bool) -> dict[str, Any]:
    node: dict[str, Any] = {"key": r.choice(KEYS)}
    if r.random() < 0.5:
        node["value"] = r.choice(VALUES)
    cap = depth > 0 and not under_cap and r.random() < 0.35
    limited = cap or r.random() < 0.75
    if limited:
        if r.random() < 0.25:
            node["rate_limits"] = [_limit(r, cap, True) for _ in range(r.randint(1, 3))]
        else:
            node["rate_limit"] = _limit(r, cap, False)
    if r.random() < 0.2:
        concurrency: dict[str, Any] = {"max_in_flight": r.choice([1, 2, 5])}
        if r.random() < 0.5:
            concurrency["max_duration"] = r.choice([1, 300])
        if r.random() < 0.4:
            concurrency["released_by"] = r.choice(["request_id", "negative_hits"])
        node["concurrency"] = concurrency
    elif not cap and _fixed(node.get("rate_limit")) and r.random() < 0.5:
        reservation: dict[str, Any] = {}
        if r.random() < 0.6:
            reservation["default"] = r.choice([1, 5, 4294967295])
        if r.random() < 0.4:
            reservation["max_duration"] = r.choice([1, 604800])
        node["reservation"] = reservation
    if cap:
        fair: dict[str, Any] = {"active_clients": r.choice([1, 2, 10, 1000000])}
        if r.random() < 0.5:
            fair["weights"] = {r.choice(["x", "c0", "ü"]): r.choice([0.001, 1, 3.5, 1e9])}
        node["fair_share"] = fair
    for flag in ("shadow_mode", "detailed_metric", "value_to_metric", "quota_mode"):
        if r.random() < 0.07:
            node[flag] = True
    if "*" in str(node.get("value", "")) and r.random() < 0.3:
        node["share_threshold"] = True
    if node.get("quota_mode") and r.random() < 0.5:
        node["quota_group"] = r.choice(["g", "h"])
    if r.random() < 0.1:
        node["metadata"] = {"k": r.choice([1, "s", {"x": [1, 2]}])}
    if depth > 0 and (cap or r.random() < 0.5):
        count = r.randint(1, 3)
        node["descriptors"] = [_node(r, depth - 1, under_cap or cap) for _ in range(count)]
    return node


def draw_config(r: random.Random) -> dict[str, Any]:
    """A descriptor file's content (domain ``d``); the loader may refuse it."""
    config: dict[str, Any] = {
        "domain": "d",
        "descriptors": [_node(r, r.randint(0, 3), False) for _ in range(r.randint(1, 4))],
    }
    if r.random() < 0.2:
        config["request_id_keys"] = {"acquire": "request_id", "release": "request_done"}
    return config


def draw_accepted(r: random.Random, path: Path) -> tuple[dict[str, Any], Loaded]:
    """The next config of ``r`` the loader accepts (written to ``path``), and it loaded."""
    while True:
        config = draw_config(r)
        path.write_text(yaml.safe_dump(config, allow_unicode=True))
        try:
            return config, load([path])
        except ConfigError:
            continue


def _paths(node: dict[str, Any], above: tuple[tuple[str, str | None], ...] = ()
           ) -> Iterator[tuple[tuple[str, str | None], ...]]:  # fmt: skip
    value = node.get("value")
    here = (*above, (str(node["key"]), None if value is None else str(value).replace("*", "q")))
    yield here
    for child in node.get("descriptors", []):
        yield from _paths(child, here)


def _entries(r: random.Random, config: dict[str, Any]) -> list[tuple[str, str]]:
    paths = [p for node in config["descriptors"] for p in _paths(node)]
    if r.random() < 0.8:
        entries = [(k, r.choice(["c0", "c1", "x", "ü", ""]) if v is None else v)
                   for k, v in r.choice(paths)]  # fmt: skip
    else:
        entries = [(r.choice(KEYS + ODD_TEXTS), r.choice(VALUES + ODD_TEXTS))
                   for _ in range(r.randint(0, 4))]  # fmt: skip
    if r.random() < 0.3:
        entries.append((r.choice(ID_KEYS), r.choice(["r1", "r2", "", "ü"])))
    if r.random() < 0.05:
        entries = entries * 2
    return entries


def draw_request(r: random.Random, config: dict[str, Any]) -> rls_pb2.RateLimitRequest:
    """A request for ``config``'s domain (now and then another), often on its paths."""
    descriptors = []
    for _ in range(r.choice([0, 1, 1, 1, 2, 3, 10])):
        descriptor = D(entries=[D.Entry(key=k, value=v) for k, v in _entries(r, config)])
        if r.random() < 0.3:
            descriptor.hits_addend.value = r.choice(HITS)
        if r.random() < 0.15:
            descriptor.limit.requests_per_unit = r.choice([0, 1, 5, 4294967295])
            descriptor.limit.unit = r.choice([0, 1, 2, 3, 4, 5, 6, 7, 8, 99])  # type: ignore[assignment]
        descriptor.is_negative_hits = r.random() < 0.15
        descriptors.append(descriptor)
    if descriptors and r.random() < 0.1:
        descriptors.append(descriptors[0])
    domain = config["domain"] if r.random() < 0.9 else r.choice(ODD_TEXTS)
    hits = r.choice([0, 0, 1, 5, 4294967295])
    return rls_pb2.RateLimitRequest(domain=domain, descriptors=descriptors, hits_addend=hits)
