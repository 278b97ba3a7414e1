"""Request entries -> the matched rule, as envoyproxy/ratelimit walks its tree.

Per level: the exact value first, then wildcard values in declaration order, then the
value-less key. A rule applies only when the request is exactly as deep as it; there is no
backtracking to a sibling and no fallback to a parent's limit. Keys and values are compared
as separate strings, never joined. A request's value longer than MAX_TEXT comes as its
stand-in (core/values.py), so an exact value that long is indexed as its stand-in.
"""

import re
from collections.abc import Sequence
from dataclasses import dataclass

from fairlimit.core.rules import Config, Rule
from fairlimit.core.values import bounded_value

Entry = tuple[str, str]


@dataclass(frozen=True, slots=True)
class Match:
    """The rule a descriptor matched, with the rules on the way down to it."""

    rule: Rule
    trail: tuple[Rule, ...]  # every matched node, outermost first, ending with ``rule``
    # (entry index, wildcard pattern) of every share_threshold level on the trail: all the
    # values that pattern matches share one counter there.
    shared: tuple[tuple[int, str], ...] = ()


def _wildcard_regex(pattern: str) -> re.Pattern[str]:
    return re.compile(".*".join(re.escape(part) for part in pattern.split("*")), re.DOTALL)


class _Level:
    """The children of one node, indexed for matching, each with its Match made once.

    A node is reached only through its ancestors, so its trail is known at load time.
    """

    __slots__ = ("exact", "valueless", "wildcards")

    def __init__(self, rules: Sequence[Rule], above: tuple[Rule, ...] = ()) -> None:
        self.exact: dict[Entry, tuple[Match, _Level]] = {}
        self.wildcards: dict[str, list[tuple[re.Pattern[str], Match, _Level]]] = {}
        self.valueless: dict[str, tuple[Match, _Level]] = {}
        for rule in rules:
            trail = (*above, rule)
            shared = tuple(
                (i, r.value) for i, r in enumerate(trail) if r.share_threshold and r.value
            )
            node = Match(rule, trail, shared)
            below = _Level(rule.children, trail)
            if rule.value is None:
                self.valueless[rule.key] = (node, below)
            elif rule.is_wildcard:
                pattern = _wildcard_regex(rule.value)
                self.wildcards.setdefault(rule.key, []).append((pattern, node, below))
            else:
                self.exact[(rule.key, bounded_value(rule.value))] = (node, below)

    def find(self, key: str, value: str) -> "tuple[Match, _Level] | None":
        found = self.exact.get((key, value))
        if found is not None:
            return found
        for pattern, node, below in self.wildcards.get(key, ()):
            if pattern.fullmatch(value):
                return node, below
        return self.valueless.get(key)


class Matcher:
    """Precompiled matching for a whole configuration."""

    def __init__(self, config: Config) -> None:
        self.config = config
        self._domains = {name: _Level(d.rules) for name, d in config.domains.items()}

    def has_domain(self, domain: str) -> bool:
        return domain in self._domains

    def match(self, domain: str, entries: Sequence[Entry]) -> Match | None:
        """The rule for ``entries`` in ``domain``, or None when no rule applies."""
        level = self._domains.get(domain)
        if level is None or not entries:
            return None
        node: Match | None = None
        for key, value in entries:
            found = level.find(key, value)
            if found is None:
                return None
            node, level = found
        return node
