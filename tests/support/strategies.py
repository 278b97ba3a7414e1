"""Shared Hypothesis strategies: rule trees, request entries, counter keys, cap periods."""

import math
from dataclasses import dataclass

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


# --- descriptor files of mixed windows (issue 37) ------------------------------------------------


@dataclass(frozen=True)
class LimitSpec:
    """One limit of a generated file: ``count`` per ``window`` seconds, counted as
    ``algorithm`` (``burst`` for gcra), or per civil ``calendar`` = (unit, zone)."""

    yaml: str
    count: int
    window: int
    algorithm: str = "fixed"
    burst: int = 0
    calendar: tuple[str, str] | None = None

    @property
    def way(self) -> tuple[int, str, tuple[str, str] | None]:
        """How it counts: two limits of one rule may not count the same way."""
        return self.window, self.algorithm, self.calendar


@dataclass(frozen=True)
class NodeSpec:
    """A generated rule: a ``fair_share`` cap when ``active`` is set."""

    key: str
    value: str | None
    limits: tuple[LimitSpec, ...]
    active: int | None = None
    weights: tuple[tuple[str, float], ...] = ()
    children: tuple["NodeSpec", ...] = ()

    def yaml(self, indent: str) -> list[str]:
        lines = [f"{indent}- key: {self.key}"]
        if self.value is not None:
            lines.append(f"{indent}  value: {self.value}")
        if len(self.limits) == 1 and self.limits[0].calendar is None and not self.active:
            lines.append(f"{indent}  rate_limit: {self.limits[0].yaml}")
        else:
            lines.append(f"{indent}  rate_limits:")
            lines.extend(f"{indent}    - {limit.yaml}" for limit in self.limits)
        if self.active is not None:
            weights = ", ".join(f"{c}: {w}" for c, w in self.weights)
            lines.append(f"{indent}  fair_share: {{active_clients: {self.active}, "
                         f"weights: {{{weights}}}}}")  # fmt: skip
        if self.children:
            lines.append(f"{indent}  descriptors:")
            for child in self.children:
                lines.extend(child.yaml(indent + "    "))
        return lines


@dataclass(frozen=True)
class TreeSpec:
    """A generated descriptor file (domain ``p``) and the entries a client sends."""

    rules: tuple[NodeSpec, ...]
    paths: tuple[tuple[tuple[str, str], ...], ...]  # one per client

    @property
    def text(self) -> str:
        lines = ["domain: p", "descriptors:"]
        for rule in self.rules:
            lines.extend(rule.yaml("  "))
        return "\n".join(lines) + "\n"

    def levels(self, path: tuple[tuple[str, str], ...]) -> list[tuple[tuple[str, ...], NodeSpec]]:
        """The rules a request of ``path`` charges, with their counter's identity: the
        leaf's, and every cap above it (a cap's limits apply to all its clients together)."""
        out: list[tuple[tuple[str, ...], NodeSpec]] = []
        level = self.rules
        for depth, (key, value) in enumerate(path):
            exact = [n for n in level if n.key == key and n.value == value]
            node = (exact or [n for n in level if n.key == key and n.value is None])[0]
            identity = tuple(f"{k}={v}" for k, v in path[: depth + 1])
            if depth == len(path) - 1 or node.active is not None:
                out.append((identity, node))
            level = node.children
        return out


# Fixed windows a cap may count in (a unit, a multiplier, a duration: any interval).
_CAP_WINDOWS = [
    ("unit: second", 1), ("unit: minute", 60), ("unit: hour", 3600), ("duration: 10s", 10),
    ("unit: second, multiplier: 3", 3), ("duration: 90s", 90),
]  # fmt: skip
# Windows a client's limit may count in: second to month, odd intervals among them.
_CLIENT_WINDOWS = [
    *_CAP_WINDOWS, ("unit: day", 86400), ("unit: week", 7 * 86400), ("unit: month", 30 * 86400),
    ("duration: 7s", 7), ("duration: 2h", 7200), ("unit: minute, multiplier: 5", 300),
]  # fmt: skip
_CALENDARS = [
    (unit, zone) for unit in ("day", "week", "month") for zone in ("UTC", "Europe/Berlin")
]
_NOMINAL = {"day": 86400, "week": 7 * 86400, "month": 30 * 86400}


@st.composite
def client_limits(draw: st.DrawFn) -> LimitSpec:
    """One limit of a client's rule: fixed, sliding, gcra (with a burst) or calendar, of
    1 to 12 hits."""
    count = draw(st.integers(1, 12))
    kind = draw(st.sampled_from(["fixed", "fixed", "sliding", "gcra", "calendar"]))
    if kind == "calendar":
        unit, zone = draw(st.sampled_from(_CALENDARS))
        text = f"{{unit: {unit}, requests_per_unit: {count}, calendar: {zone}}}"
        return LimitSpec(text, count, _NOMINAL[unit], calendar=(unit, zone))
    window, seconds = draw(st.sampled_from(_CLIENT_WINDOWS))
    if kind == "fixed":
        return LimitSpec(f"{{{window}, requests_per_unit: {count}}}", count, seconds)
    if kind == "sliding":
        text = f"{{{window}, requests_per_unit: {count}, algorithm: sliding}}"
        return LimitSpec(text, count, seconds, "sliding")
    burst = draw(st.integers(0, 4))
    text = f"{{{window}, requests_per_unit: {count}, algorithm: gcra, burst: {burst}}}"
    return LimitSpec(text, count, seconds, "gcra", burst)


@st.composite
def cap_limits(draw: st.DrawFn) -> LimitSpec:
    """One limit of a cap: a fixed window of 1 to 40 hits."""
    count = draw(st.integers(1, 40))
    window, seconds = draw(st.sampled_from(_CAP_WINDOWS))
    return LimitSpec(f"{{{window}, requests_per_unit: {count}}}", count, seconds)


def _distinct(limits: list[LimitSpec]) -> tuple[LimitSpec, ...]:
    """The limits without a second one counting the same way (the loader refuses that)."""
    seen: dict[object, LimitSpec] = {}
    for limit in limits:
        seen.setdefault(limit.way, limit)
    return tuple(seen.values())


def _limits(draw: st.DrawFn, each: st.SearchStrategy[LimitSpec]) -> tuple[LimitSpec, ...]:
    return _distinct(draw(st.lists(each, min_size=1, max_size=3)))


@st.composite
def window_trees(draw: st.DrawFn) -> TreeSpec:
    """A file that ``fairlimit check`` accepts: a ``fair_share`` cap (1 or 2 limits, any
    active_clients, a weighted client) over clients with 1 to 3 limits of mixed windows and
    algorithms, one client named with limits of its own, or over tenant caps of users
    (nesting); sometimes a rule outside any cap beside it. Clients send the paths listed."""
    nested = draw(st.booleans())
    cap = dict(key="route", value="r", limits=_limits(draw, cap_limits()),
               active=draw(st.integers(1, 12)))  # fmt: skip
    paths: list[tuple[tuple[str, str], ...]] = []
    if nested:
        users = NodeSpec("user", None, _limits(draw, client_limits()))
        tenant = NodeSpec("tenant", None, _limits(draw, cap_limits()),
                          active=draw(st.integers(1, 6)), children=(users,))  # fmt: skip
        weights = (("t0", draw(st.sampled_from([1.0, 2.0, 3.5]))),)
        top = NodeSpec(**cap, weights=weights, children=(tenant,))  # type: ignore[arg-type]
        paths = [(("route", "r"), ("tenant", f"t{i % 2}"), ("user", f"u{i}")) for i in range(4)]
    else:
        children = [NodeSpec("client", None, _limits(draw, client_limits()))]
        if draw(st.booleans()):
            children.insert(0, NodeSpec("client", "vip", _limits(draw, client_limits())))
        weights = (("c0", draw(st.sampled_from([1.0, 2.0, 3.5]))),)
        top = NodeSpec(**cap, weights=weights, children=tuple(children))  # type: ignore[arg-type]
        paths = [(("route", "r"), ("client", name)) for name in ("c0", "c1", "c2", "vip")]
    rules = [top]
    if draw(st.booleans()):
        rules.append(NodeSpec("flat", None, _limits(draw, client_limits())))
        paths += [(("flat", "f0"),), (("flat", "f1"),)]
    return TreeSpec(tuple(rules), tuple(paths))
