"""Shared Hypothesis strategies: rule trees, request entries, counter keys, cap periods."""

import math

from hypothesis import strategies as st

from fairlimit.core.fairshare import PeriodDemand
from fairlimit.core.rules import RateLimit, Rule
from fairlimit.core.units import Unit

KEYS = st.sampled_from(["a", "b", "a_b", "k"])
VALUES = st.sampled_from(["x", "y", "x_y", "xy", "", "ü", "x*", "*y", "*"])
PLAIN_VALUES = st.sampled_from(["x", "y", "x_y", "xy", "ü", "zz", "x/=y"])


@st.composite
def rule_trees(draw: st.DrawFn, depth: int = 3) -> tuple[Rule, ...]:
    """A level of rules with unique (key, value) pairs, nested up to ``depth``."""
    count = draw(st.integers(0, 4))
    rules: dict[tuple[str, str | None], Rule] = {}
    for _ in range(count):
        key = draw(KEYS)
        raw = draw(st.one_of(st.none(), VALUES))
        value = None if raw in (None, "") else raw
        if (key, value) in rules:
            continue
        children = draw(rule_trees(depth - 1)) if depth > 1 else ()
        limit = RateLimit(draw(st.integers(0, 5)), Unit.SECOND)
        rules[(key, value)] = Rule(key, value, f"d/{key}={value}", "f", limit, children=children)
    return tuple(rules.values())


@st.composite
def entries_lists(draw: st.DrawFn, rules: tuple[Rule, ...]) -> list[tuple[str, str]]:
    """Entries that often follow the tree and sometimes stray from it."""
    entries: list[tuple[str, str]] = []
    level = rules
    for _ in range(draw(st.integers(1, 4))):
        if level and draw(st.booleans()):
            rule = draw(st.sampled_from(level))
            plain = rule.value is None or "*" in rule.value
            value = draw(PLAIN_VALUES) if plain else str(rule.value)
            entries.append((rule.key, value))
            level = rule.children
        else:
            entries.append((draw(KEYS), draw(PLAIN_VALUES)))
            level = ()
    return entries


# Text rich in the characters a counter key escapes or splits on.
KEY_TEXT = st.text(st.sampled_from("ab\\/=#%{}ü"), max_size=6) | st.text(max_size=6)


@st.composite
def descriptor_keys(draw: st.DrawFn) -> tuple[str, list[tuple[str, str]], int]:
    """(domain, entries, window) for a counter key: non-empty domain and keys."""
    domain = draw(KEY_TEXT.filter(bool))
    entries = draw(st.lists(st.tuples(KEY_TEXT.filter(bool), KEY_TEXT), max_size=4))
    return domain, entries, draw(st.integers(1, 10**8))


@st.composite
def periods(draw: st.DrawFn) -> PeriodDemand:
    """A finished period at a cap: 1 to 12 clients, a window of 1 to 60 periods."""
    n = draw(st.integers(1, 12))
    amounts = st.lists(st.integers(0, 1000).map(float), min_size=n, max_size=n)
    demands = draw(amounts)
    admitted = tuple(min(a, d) for a, d in zip(draw(amounts), demands, strict=True))
    scale = float(draw(st.integers(1, 60)))
    limits = draw(st.lists(st.floats(1, 10**5) | st.just(math.inf), min_size=n, max_size=n))
    weights = draw(st.lists(st.floats(0.1, 10), min_size=n, max_size=n))
    capacity = draw(st.floats(1, 10**5))
    return PeriodDemand(capacity, scale, tuple(demands), admitted, tuple(limits), tuple(weights))


# --- max-min allocations (tests/support/maxmin.py) ----------------------------------------------

AMOUNTS = st.integers(0, 1000)
WEIGHTS = st.integers(1, 10)


@st.composite
def allocation_cases(
    draw: st.DrawFn, max_clients: int = 12
) -> tuple[list[int], list[int], list[int], int]:
    """(demands, limits, weights, capacity) in whole numbers, so exact rationals follow."""
    n = draw(st.integers(1, max_clients))
    demands = draw(st.lists(AMOUNTS, min_size=n, max_size=n))
    limits = draw(st.lists(AMOUNTS, min_size=n, max_size=n))
    weights = draw(st.lists(WEIGHTS, min_size=n, max_size=n))
    return demands, limits, weights, draw(st.integers(0, 5000))
