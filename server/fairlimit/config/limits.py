"""A node's limits from YAML: ``rate_limit`` (upstream's) or ``rate_limits`` (a list).

Each limit has a window (``unit`` with an optional ``multiplier``, or a ``duration``), an
optional ``calendar`` time zone for civil days, weeks, months and years, and an
``algorithm`` (``fixed``, ``sliding``, ``gcra`` with ``burst``). docs/configuration.md lists
every key and every message here.
"""

import re
from collections.abc import Mapping
from typing import Any, Protocol
from zoneinfo import ZoneInfo, ZoneInfoNotFoundError

from fairlimit.config.yaml_text import Plain, as_bool, as_int
from fairlimit.core.rules import RateLimit
from fairlimit.core.units import CALENDAR_UNITS, UTC_ZONE, Algorithm, Calendar, Shape, Unit

RATE_LIMIT_KEYS = frozenset(
    {"unit", "requests_per_unit", "unlimited", "name", "replaces", "charge_when_over_limit",
     "multiplier", "duration", "calendar", "algorithm", "burst"}
)  # fmt: skip
MAX_LIMITS = 8  # limits on one node: each is a counter every request there charges
MAX_MULTIPLIER = 1_000_000
MAX_SECONDS = 10 * 366 * 86400  # ten years
UINT32 = 0xFFFFFFFF
_DURATION = re.compile(r"([0-9]+)(s|m|h|d)")
_SCALE = {"s": 1, "m": 60, "h": 3600, "d": 86400}
_OCTAL_HINT = " (upstream reads a leading zero as octal: write it without)"


class Sink(Protocol):
    """Where problems go (config/loader.Problems)."""

    def add(self, path: str, message: str) -> None: ...


class _Prefixed:
    """Problems of one entry of ``rate_limits``: each message names the entry."""

    def __init__(self, problems: Sink, prefix: str) -> None:
        self._problems, self._prefix = problems, prefix

    def add(self, path: str, message: str) -> None:
        self._problems.add(path, f"{self._prefix}: {message}")


def _shown(value: object) -> str:
    return str(value) if isinstance(value, Plain) else repr(value)


def _octal(value: object) -> bool:
    return isinstance(value, Plain) and len(value) > 1 and value.startswith("0")


def _flag(problems: Sink, path: str, node: Mapping[str, Any], key: str) -> bool:
    raw = node.get(key)
    value = False if raw is None else as_bool(raw)
    if value is None:
        problems.add(path, f"'{key}' must be true or false, not {raw!r}")
        return False
    return value


def _replaces(problems: Sink, path: str, raw: object, name: str | None) -> tuple[str, ...]:
    if raw is None:
        return ()
    if not isinstance(raw, list):
        problems.add(path, "rate_limit.replaces must be a list of {name: ...}")
        return ()
    names: list[str] = []
    for entry in raw:
        if not isinstance(entry, dict):  # a bare name (``[users]``) is not an empty entry
            problems.add(path, "rate_limit.replaces must be a list of {name: ...}")
            continue
        for key in sorted(str(k) for k in entry if k != "name"):
            problems.add(path, f"unknown key '{key}'")
        target = entry.get("name")
        if not isinstance(target, str) or not target:
            problems.add(path, "should not have an empty replaces entry")
        elif target == name:
            problems.add(path, "replaces should not contain name of same descriptor")
        else:
            names.append(target)
    return tuple(names)


def _duration(problems: Sink, path: str, raw: object) -> int | None:
    text = str(raw).strip()
    found = _DURATION.fullmatch(text)
    seconds = int(text) if as_int(raw) is not None else None
    if found is not None:
        seconds = int(found.group(1)) * _SCALE[found.group(2)]
    if seconds is None or not 1 <= seconds <= MAX_SECONDS:
        problems.add(
            path,
            "duration must be whole seconds, minutes, hours or days from 1s to 3660d "
            f"(30s, 5m, 2h, 7d), not {_shown(raw)}",
        )
        return None
    return seconds


def _window(
    old: Sink, problems: Sink, path: str, raw: Mapping[str, Any]
) -> tuple[Unit, int] | None:
    """(unit, seconds) of the limit's window; seconds 0 when it is the unit's own."""
    unit_text, raw_duration = raw.get("unit"), raw.get("duration")
    if raw_duration is not None:
        if unit_text is not None or raw.get("multiplier") is not None:
            problems.add(path, "takes either a unit (and multiplier) or a duration")
            return None
        seconds = _duration(problems, path, raw_duration)
        return None if seconds is None else (Unit.within(seconds), seconds)
    try:
        unit = Unit.parse(str(unit_text)) if unit_text is not None else None
    except KeyError:
        unit = None
    if unit is None:
        old.add(path, f"invalid rate limit unit '{unit_text if unit_text else ''}'")
        return None
    raw_multiplier = raw.get("multiplier")
    if raw_multiplier is None:
        return unit, 0
    multiplier = as_int(raw_multiplier)
    if multiplier is None or not 1 <= multiplier <= MAX_MULTIPLIER:
        problems.add(
            path,
            f"multiplier must be an integer from 1 to {MAX_MULTIPLIER}, "
            f"not {_shown(raw_multiplier)}",
        )
        return None
    return unit, 0 if multiplier == 1 else unit.seconds * multiplier


def _calendar(problems: Sink, path: str, raw: Mapping[str, Any], unit: Unit,
              seconds: int) -> Calendar | None:  # fmt: skip
    name = raw.get("calendar")
    if name is None:
        return None
    if unit not in CALENDAR_UNITS or seconds:
        problems.add(
            path, "calendar needs unit day, week, month or year (no multiplier, no duration)"
        )
        return None
    text = str(name)
    if text == "UTC":
        return Calendar(unit, text, UTC_ZONE)
    try:
        return Calendar(unit, text, ZoneInfo(text))
    except (ZoneInfoNotFoundError, ValueError):
        problems.add(path, f"calendar: unknown time zone '{text}'")
        return None


def _shape(problems: Sink, path: str, raw: Mapping[str, Any], rpu: int,
           calendar: Calendar | None) -> Shape | None:  # fmt: skip
    text = raw.get("algorithm")
    try:
        algorithm = Algorithm(str(text)) if text is not None else Algorithm.FIXED
    except ValueError:
        problems.add(path, f"algorithm must be fixed, sliding or gcra, not '{text}'")
        return None
    raw_burst = raw.get("burst")
    burst = 0 if raw_burst is None else as_int(raw_burst)
    if raw_burst is not None and algorithm is not Algorithm.GCRA:
        problems.add(path, "burst is for algorithm gcra only")
    elif burst is None or not 0 <= burst <= UINT32:
        problems.add(path, f"burst must be an integer from 0 to {UINT32}, not {_shown(raw_burst)}")
        burst = 0
    if calendar is not None and algorithm is not Algorithm.FIXED:
        problems.add(path, "calendar windows count with algorithm fixed only")
    if algorithm is Algorithm.GCRA and rpu == 0:
        problems.add(path, "algorithm gcra needs requests_per_unit of 1 or more")
    if algorithm is Algorithm.FIXED and calendar is None:
        return None
    return Shape(algorithm, burst or 0, calendar)


def rate_limit(
    problems: Sink, path: str, raw: object, entry: str | None = None
) -> RateLimit | None:
    """One limit: ``rate_limit``, or the ``entry`` of ``rate_limits`` (each message of the
    keys upstream does not have names which)."""
    if entry is not None:
        problems = _Prefixed(problems, entry)
    new = problems if entry is not None else _Prefixed(problems, "rate_limit")
    if not isinstance(raw, dict):
        problems.add(path, "must be a mapping" if entry else "rate_limit must be a mapping")
        return None
    for key in sorted(str(k) for k in raw if k not in RATE_LIMIT_KEYS):
        problems.add(path, f"unknown key '{key}'")
    unlimited = _flag(problems, path, raw, "unlimited")
    said = raw.get("charge_when_over_limit") is not None
    charge = _flag(problems, path, raw, "charge_when_over_limit") if said else None
    name = raw.get("name")
    name = str(name) if isinstance(name, str) else name
    if name is not None and not isinstance(name, str):
        problems.add(path, f"rate_limit.name must be a string, not {name!r}")
        name = None
    replaces = _replaces(problems, path, raw.get("replaces"), name)
    if unlimited:
        if raw.get("unit") is not None:
            problems.add(path, "should not specify rate limit unit when unlimited")
        return RateLimit(0, Unit.SECOND, unlimited=True, name=name, replaces=replaces)
    window = _window(problems, new, path, raw)
    raw_rpu = raw.get("requests_per_unit")
    rpu = as_int(raw_rpu)
    if rpu is None or not 0 <= rpu <= UINT32:
        problems.add(
            path,
            f"requests_per_unit must be an integer from 0 to 4294967295, not {_shown(raw_rpu)}"
            + _OCTAL_HINT * _octal(raw_rpu),
        )
        return None
    if window is None:
        return None
    unit, seconds = window
    calendar = _calendar(new, path, raw, unit, seconds)
    shape = _shape(new, path, raw, rpu, calendar)
    return RateLimit(rpu, unit, name=name, replaces=replaces, charge_when_over_limit=charge,
                     seconds=seconds, shape=shape)  # fmt: skip


def _key(limit: RateLimit) -> tuple[int, str]:
    return limit.window, "" if limit.shape is None else limit.shape.tag


def rate_limits(problems: Sink, path: str, raw: object) -> tuple[RateLimit, ...]:
    """The limits of ``rate_limits``: a non-empty list, none unlimited, no two counted alike."""
    if not isinstance(raw, list) or not raw or len(raw) > MAX_LIMITS:
        problems.add(path, f"rate_limits must be a list of 1 to {MAX_LIMITS} rate limits")
        return ()
    limits: list[RateLimit] = []
    seen: dict[tuple[int, str], int] = {}
    for index, entry in enumerate(raw):
        where = f"rate_limits[{index}]"
        limit = rate_limit(problems, path, entry, where)
        if limit is None:
            continue
        if limit.unlimited:
            problems.add(
                path, f"{where}: cannot be unlimited (write rate_limit: {{unlimited: true}})"
            )
            continue
        first = seen.setdefault(_key(limit), index)
        if first != index:
            problems.add(
                path, f"{where} counts the same window the same way as rate_limits[{first}]"
            )
            continue
        limits.append(limit)
    return tuple(limits)


def node_limits(problems: Sink, path: str, raw: Mapping[str, Any]) -> tuple[RateLimit, ...]:
    """A descriptor node's limits: its ``rate_limit``, or its ``rate_limits``, or none."""
    if "rate_limit" in raw and "rate_limits" in raw:
        problems.add(
            path, "rate_limit and rate_limits cannot both be set: list every limit in rate_limits"
        )
        return ()
    if "rate_limits" in raw:
        return rate_limits(problems, path, raw["rate_limits"])
    if "rate_limit" in raw:
        one = rate_limit(problems, path, raw["rate_limit"])
        return () if one is None else (one,)
    return ()
