"""Reading a scenario file: every problem collected as ``FILE: PATH: message``."""

import math
from collections.abc import Callable, Mapping
from typing import Any

from fairlimit.config.loader import Problems

Rule = tuple[str, Callable[[float], bool]]  # what a number must be, and the test


def within(low: float, high: float, what: str = "a number") -> Rule:
    return f"{what} from {low:g} to {high:g}", lambda x: low <= x <= high


def after(low: float, high: float, what: str) -> Rule:
    return f"a number above {what} ({low:g}) up to duration ({high:g})", lambda x: low < x <= high


ABOVE_ZERO: Rule = ("a number above 0", lambda x: x > 0)


class Reader(Problems):
    """Reads one scenario file, collecting every problem as ``FILE: PATH: message``."""

    def mapping(self, raw: object, path: str, keys: frozenset[str]) -> Mapping[str, Any] | None:
        if not isinstance(raw, dict):
            self.add(path, f"must be a mapping, not {raw!r}")
            return None
        for key in sorted(str(k) for k in raw if k not in keys):
            self.add(path, f"unknown key '{key}'")
        return raw

    def text(self, raw: Mapping[str, Any], key: str, path: str) -> str:
        value = raw.get(key)
        if isinstance(value, int | float) and not isinstance(value, bool):
            value = str(value)  # YAML reads `value: 42` as a number; Envoy sends text
        if not isinstance(value, str) or not value:
            self.add(path, "is required" if key not in raw else f"must be text, not {value!r}")
            return ""
        return value

    def number(
        self, raw: Mapping[str, Any], key: str, path: str, rule: Rule, default: float | None
    ) -> float | None:
        """``raw[key]`` if ``rule`` accepts it, ``default`` when absent, else None."""
        if key not in raw:
            if default is None:
                self.add(path, "is required")
            return default
        value = raw[key]
        ok = isinstance(value, int | float) and not isinstance(value, bool)
        if not ok or not math.isfinite(value) or not rule[1](value):
            self.add(path, f"must be {rule[0]}, not {value!r}")
            return None
        return float(value)

    def integer(self, node: Mapping[str, Any], key: str, path: str, top: int) -> int:
        """``node[key]`` if a whole number from 0 to ``top`` (0 when absent), else 0."""
        value = node.get(key, 0)
        if isinstance(value, bool) or not isinstance(value, int) or not 0 <= value <= top:
            self.add(path, f"must be an integer from 0 to {top}, not {value!r}")
            return 0
        return value
