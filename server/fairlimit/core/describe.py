"""How the operator views write a limit: ``/rlconfig`` (JSON and upstream's text line),
``/top`` and ``fairlimit top``, ``fairlimit check`` and ``fairlimit simulate``.

One place, so that every view names the same window, algorithm, burst and calendar zone of
each of a rule's limits. A *plain* limit is what envoyproxy/ratelimit can write (a fixed
window of one unit): the views keep upstream's output for a rule with one such limit.
"""

from collections.abc import Mapping

from fairlimit.core.rules import RateLimit, Rule
from fairlimit.core.units import Algorithm, Unit

_DURATION_SUFFIXES = (("d", 86400), ("h", 3600), ("m", 60))


def duration_text(seconds: int) -> str:
    """A window as the ``duration`` key takes it: ``5m``, ``2h``, ``7d``, ``90s``."""
    for suffix, size in _DURATION_SUFFIXES:
        if seconds % size == 0:
            return f"{seconds // size}{suffix}"
    return f"{seconds}s"


def is_plain(limit: RateLimit) -> bool:
    """Whether upstream could write ``limit``: unlimited, or a fixed window of one unit."""
    return limit.unlimited or (limit.seconds == 0 and limit.shape is None)


def has_plain_limits(rule: Rule) -> bool:
    """Whether ``rule`` has at most one limit and it is plain: the views show it as before."""
    return len(rule.limits) <= 1 and all(is_plain(limit) for limit in rule.limits)


def limit_fields(limit: RateLimit) -> dict[str, object]:
    """``limit`` as JSON-ready fields: ``unit``, ``requests_per_unit``, ``window_seconds``
    and ``algorithm`` always, ``burst`` for gcra, ``calendar`` (the zone) when set;
    ``{"unlimited": true}`` for an unlimited one. ``words`` reads these fields back."""
    if limit.unlimited:
        return {"unlimited": True}
    out: dict[str, object] = {
        "unit": limit.unit.name.lower(),
        "requests_per_unit": limit.requests_per_unit,
        "window_seconds": limit.window,
        "algorithm": limit.algorithm.value,
    }
    shape = limit.shape
    if shape is not None and shape.algorithm is Algorithm.GCRA:
        out["burst"] = shape.burst
    if shape is not None and shape.calendar is not None:
        out["calendar"] = shape.calendar.name
    return out


def words(fields: Mapping[str, object]) -> str:
    """A limit's fields (``limit_fields``) in words: ``100 per second``, ``20000 per 5m,
    sliding``, ``3000 per minute, gcra, burst 50``, ``1000000 per calendar month in
    Europe/Berlin``, ``unlimited``. Takes the fields rather than a RateLimit so that
    ``fairlimit top`` can write what ``GET /top`` sent."""
    if fields.get("unlimited"):
        return "unlimited"
    unit = str(fields["unit"])
    window = int(str(fields["window_seconds"]))
    zone = fields.get("calendar")
    if zone is not None:
        per = f"calendar {unit} in {zone}"
    elif window == Unit.parse(unit).seconds:
        per = unit
    else:
        per = duration_text(window)
    text = f"{fields['requests_per_unit']} per {per}"
    algorithm = fields.get("algorithm", Algorithm.FIXED.value)
    if algorithm != Algorithm.FIXED.value:
        text += f", {algorithm}"
    if "burst" in fields:
        text += f", burst {fields['burst']}"
    return text


def limit_words(limit: RateLimit) -> str:
    """``limit`` in words (see ``words``)."""
    return words(limit_fields(limit))


def limits_words(rule: Rule) -> str:
    """Every limit of ``rule`` in words, ``; `` between them (``unlimited`` or ``none``)."""
    return "; ".join(limit_words(limit) for limit in rule.limits) or "none"


def debug_text(limit: RateLimit) -> str:
    """``limit`` as upstream's ``/rlconfig`` line writes one, ``unit=SECOND
    requests_per_unit=100``, then what upstream cannot say: ``window=5m`` (a multiplier or
    a duration), ``algorithm=sliding``, ``algorithm=gcra burst=50``, ``calendar=ZONE``."""
    if limit.unlimited:
        return "unlimited"
    parts = [f"unit={limit.unit.name}", f"requests_per_unit={limit.requests_per_unit}"]
    if limit.seconds:
        parts.append(f"window={duration_text(limit.seconds)}")
    shape = limit.shape
    if shape is not None and shape.algorithm is not Algorithm.FIXED:
        parts.append(f"algorithm={shape.algorithm.value}")
    if shape is not None and shape.algorithm is Algorithm.GCRA:
        parts.append(f"burst={shape.burst}")
    if shape is not None and shape.calendar is not None:
        parts.append(f"calendar={shape.calendar.name}")
    return " ".join(parts)
