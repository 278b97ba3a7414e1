"""An RLQS bucket id (an unordered key/value map) -> the descriptor entries it stands for.

Envoy's rate_limit_quota filter names a bucket by a map, ``{client_id: alice, route: public}``,
whose key order means nothing; a descriptor is an ordered list of entries. The rule tree of
the report's domain gives the order: walking down from the top, each level takes the first
rule key, in declaration order, that the bucket still holds, and descends into the rule that
``(key, value)`` matches there (exact value, then wildcards in declaration order, then the
value-less key, as for RLS). Every key of the bucket must be used: a bucket with a key the
walk never reaches, or a value no rule of its level matches, maps to nothing (as an RLS
descriptor deeper or shallower than every rule gets no limit).
"""

import re
from collections.abc import Mapping, Sequence

from fairlimit.core.matching import Entry
from fairlimit.core.rules import Domain, Rule
from fairlimit.core.values import bounded_value

BucketKey = tuple[tuple[str, str], ...]  # the bucket map as sorted (key, value) pairs


def bucket_key(bucket: Mapping[str, str]) -> BucketKey:
    """The bucket map in a hashable, order-free form."""
    if len(bucket) == 2:  # the common shape (route and client), without a sort: per line
        first, second = bucket.items()
        return (first, second) if first < second else (second, first)
    return tuple(sorted(bucket.items()))


def _matches(pattern: str, value: str) -> bool:
    regex = ".*".join(re.escape(part) for part in pattern.split("*"))
    return re.fullmatch(regex, value, re.DOTALL) is not None


def _rule_for(rules: Sequence[Rule], key: str, value: str) -> Rule | None:
    """The rule of one level that ``(key, value)`` matches, with RLS's precedence (an exact
    value past MAX_TEXT as its stand-in, as the bucket's values come: core/values.py)."""
    keyed = [r for r in rules if r.key == key]
    for rule in keyed:
        if rule.is_fixed and rule.value is not None and bounded_value(rule.value) == value:
            return rule
    for rule in keyed:
        if rule.is_wildcard and rule.value is not None and _matches(rule.value, value):
            return rule
    return next((r for r in keyed if r.value is None), None)


def entries_for(domain: Domain | None, bucket: Mapping[str, str]) -> tuple[Entry, ...] | None:
    """The descriptor entries of ``bucket`` in ``domain``'s rule order, or None if none fit."""
    if domain is None or not bucket:
        return None
    left = dict(bucket)
    rules: Sequence[Rule] = domain.rules
    entries: list[Entry] = []
    while left:
        key = next((r.key for r in rules if r.key in left), None)
        if key is None:
            return None
        value = left.pop(key)
        rule = _rule_for(rules, key, value)
        if rule is None:
            return None
        entries.append((key, value))
        rules = rule.children
    return tuple(entries)
