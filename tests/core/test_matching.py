"""Matching request entries to rules, as envoyproxy/ratelimit walks its tree."""

from pathlib import Path

import pytest
from hypothesis import given
from hypothesis import strategies as st

from fairlimit.core.matching import Matcher
from fairlimit.core.rules import Config, Domain, Rule
from fairlimit.core.values import MAX_TEXT, bounded_value
from helpers import load_text
from strategies import entries_lists, rule_trees

pytestmark = pytest.mark.unit

TREE = """
domain: d
descriptors:
  - key: k
    value: exact
    rate_limit: {unit: second, requests_per_unit: 1}
  - key: k
    value: "ex*"
    rate_limit: {unit: second, requests_per_unit: 2}
  - key: k
    value: "*act"
    rate_limit: {unit: second, requests_per_unit: 3}
  - key: k
    value: "a*b*c"
    rate_limit: {unit: second, requests_per_unit: 4}
  - key: k
    rate_limit: {unit: second, requests_per_unit: 5}
    descriptors:
      - key: sub
        rate_limit: {unit: second, requests_per_unit: 6}
  - key: a_b
    value: c
    rate_limit: {unit: second, requests_per_unit: 7}
  - key: parent
    value: p
    rate_limit: {unit: second, requests_per_unit: 8}
    descriptors:
      - key: child
        value: only
        rate_limit: {unit: second, requests_per_unit: 9}
"""


def _limit(tmp_path: Path, *entries: tuple[str, str]) -> int | None:
    matcher = Matcher(load_text(tmp_path, TREE).config)
    found = matcher.match("d", entries)
    if found is None or found.rule.rate_limit is None:
        return None
    return found.rule.rate_limit.requests_per_unit


class TestPrecedence:
    def test_exact_value_wins_over_wildcards(self, tmp_path: Path) -> None:
        """An exact value is chosen even when a wildcard also matches."""
        assert _limit(tmp_path, ("k", "exact")) == 1

    def test_wildcards_apply_in_declaration_order(self, tmp_path: Path) -> None:
        """Of two matching wildcards the one declared first applies."""
        assert _limit(tmp_path, ("k", "exact-ish")) == 2
        assert _limit(tmp_path, ("k", "react")) == 3
        # 'extract' is taken by both 'ex*' (declared first) and '*act'.
        assert _limit(tmp_path, ("k", "extract")) == 2

    def test_wildcard_star_anywhere(self, tmp_path: Path) -> None:
        """A '*' may stand anywhere in the value, and for any run of characters."""
        assert _limit(tmp_path, ("k", "a--b--c")) == 4
        assert _limit(tmp_path, ("k", "abc")) == 4

    def test_wildcard_star_takes_line_breaks_too(self, tmp_path: Path) -> None:
        """A '*' stands for any character, a newline included (values are opaque text)."""
        assert _limit(tmp_path, ("k", "a\nb\r\nc")) == 4

    def test_value_less_key_is_the_fallback(self, tmp_path: Path) -> None:
        """A value no exact or wildcard rule takes falls to the value-less key."""
        assert _limit(tmp_path, ("k", "zzz")) == 5


class TestDomains:
    def test_an_unknown_domain_matches_nothing(self, tmp_path: Path) -> None:
        """Entries under a domain no file declares match no rule."""
        matcher = Matcher(load_text(tmp_path, TREE).config)
        assert matcher.match("other", [("k", "exact")]) is None
        assert not matcher.has_domain("other") and matcher.has_domain("d")

    def test_a_matcher_keeps_its_config(self, tmp_path: Path) -> None:
        """The config it was built from, for callers that read its domains."""
        config = load_text(tmp_path, TREE).config
        assert Matcher(config).config is config


class TestDepth:
    def test_limit_applies_only_at_exact_depth(self, tmp_path: Path) -> None:
        """A descriptor deeper than the tree matches nothing, not the parent's limit."""
        assert _limit(tmp_path, ("parent", "p")) == 8
        assert _limit(tmp_path, ("parent", "p"), ("child", "only")) == 9
        assert _limit(tmp_path, ("parent", "p"), ("child", "only"), ("x", "y")) is None

    def test_no_backtracking_to_a_sibling(self, tmp_path: Path) -> None:
        """Once 'k=exact' is chosen, its missing child is not looked up under the 'k' rule."""
        assert _limit(tmp_path, ("k", "zzz"), ("sub", "1")) == 6
        assert _limit(tmp_path, ("k", "exact"), ("sub", "1")) is None

    def test_no_fallback_to_a_parent_limit(self, tmp_path: Path) -> None:
        """An unknown child under a limited parent gets no limit at all."""
        assert _limit(tmp_path, ("parent", "p"), ("child", "other")) is None


class TestSeparateStrings:
    def test_keys_and_values_never_join(self, tmp_path: Path) -> None:
        """(a_b, c) matches its rule; (a, b_c) does not collide with it."""
        assert _limit(tmp_path, ("a_b", "c")) == 7
        assert _limit(tmp_path, ("a", "b_c")) is None


LONG = "tok-" + "k" * MAX_TEXT  # one past MAX_TEXT: requests carry it as its stand-in
LONGER = "tok-" + "k" * 20_000


class TestLongExactValues:
    """A request's value past MAX_TEXT arrives as its stand-in (grpc_api/convert.py): an
    exact value that long in the config matched no request, silently (`check` said ok), and
    its requests fell to the value-less rule. It is indexed as its stand-in now."""

    TEXT = f"""
domain: d
descriptors:
  - key: token
    value: "{LONG}"
    rate_limit: {{unit: minute, requests_per_unit: 1}}
  - key: token
    value: "{LONGER}"
    rate_limit: {{unit: minute, requests_per_unit: 2}}
  - key: token
    value: "tok-*"
    rate_limit: {{unit: minute, requests_per_unit: 3}}
  - key: token
    rate_limit: {{unit: minute, requests_per_unit: 4}}
"""

    def _limit(self, tmp_path: Path, value: str) -> int | None:
        found = Matcher(load_text(tmp_path, self.TEXT).config).match("d", [("token", value)])
        limit = None if found is None else found.rule.rate_limit
        return None if limit is None else limit.requests_per_unit

    def test_a_long_exact_value_matches_the_requests_that_carry_it(self, tmp_path: Path) -> None:
        assert self._limit(tmp_path, bounded_value(LONG)) == 1
        assert self._limit(tmp_path, bounded_value(LONGER)) == 2

    def test_a_value_apart_in_its_middle_is_another_value(self, tmp_path: Path) -> None:
        """The stand-in keeps the value's ends and the hash of all of it: one character
        changed in the middle is another value (the wildcard's, here)."""
        middle = len(LONGER) // 2
        other = LONGER[:middle] + "x" + LONGER[middle + 1 :]
        assert self._limit(tmp_path, bounded_value(other)) == 3
        assert self._limit(tmp_path, bounded_value(LONG + "k")) == 3


def _glob(pattern: str, value: str) -> bool:
    """'*' matches any run of characters: the pieces must appear in order, anchored."""
    first, *middle, last = pattern.split("*")
    if not value.startswith(first):
        return False
    rest = value[len(first) :]
    for piece in middle:
        at = rest.find(piece)
        if at < 0:
            return False
        rest = rest[at + len(piece) :]
    return len(rest) >= len(last) and rest.endswith(last)


def _reference(rules: tuple[Rule, ...], entries: list[tuple[str, str]]) -> Rule | None:
    """The matching rule of docs/semantics.md, written as plainly as possible."""
    found: Rule | None = None
    level = rules
    for key, value in entries:
        exact = [r for r in level if r.key == key and r.value == value and not r.is_wildcard]
        wild = [r for r in level if r.key == key and r.is_wildcard and _glob(r.value or "", value)]
        bare = [r for r in level if r.key == key and r.value is None]
        candidates = exact or wild or bare
        if not candidates:
            return None
        found = candidates[0]
        level = found.children
    return found


class TestMatchingProperties:
    @given(rule_trees(), st.data())
    def test_matches_the_plain_reference(
        self, rules: tuple[Rule, ...], data: st.DataObject
    ) -> None:
        """The indexed matcher agrees with a plain walk of the rule list."""
        entries = data.draw(entries_lists(rules))
        matcher = Matcher(Config.of([Domain("d", "f", rules)]))
        got = matcher.match("d", entries)
        expected = _reference(rules, entries) if entries else None
        assert (got.rule if got else None) == expected
        if got is not None:
            assert [r.key for r in got.trail] == [k for k, _ in entries]
