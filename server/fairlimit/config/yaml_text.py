"""Descriptor YAML read as envoyproxy/ratelimit reads it: every scalar kept as the text written.

Upstream decodes ``value: 010`` into a string field and so keeps ``"010"``; a YAML 1.1 loader
would turn it into the integer 8 and requests carrying ``010`` would match nothing. Here every
scalar stays text (``Plain`` when written without quotes, so that the few fields that are
numbers or booleans can be read from it, and ``metadata`` can be typed as YAML would type it).
A plain ``~``/``null``/empty scalar is None, as upstream leaves such a field unset. A key that
appears twice in one mapping is an error naming both lines: upstream keeps the last one
silently, which hides a typo in a merged ConfigMap. A file's first YAML document is its
config, as upstream reads it (a trailing ``---`` is fine); a second one with content is an error.
"""

import re
from typing import Any

import yaml
from yaml.nodes import MappingNode, ScalarNode

from fairlimit.errors import ConfigUnreadable

_NULLS = frozenset({"", "~", "null", "Null", "NULL"})
_TRUE = frozenset({"y", "Y", "yes", "Yes", "YES", "true", "True", "TRUE", "on", "On", "ON"})
_DECIMAL = re.compile(r"[+-]?(?:[0-9]+(?:\.[0-9]*)?|\.[0-9]+)")
_FALSE = frozenset({"n", "N", "no", "No", "NO", "false", "False", "FALSE", "off", "Off", "OFF"})


class Plain(str):
    """A scalar written without quotes: its text, which YAML 1.1 may read as a number or bool."""

    __slots__ = ()


class _DuplicateKey(yaml.MarkedYAMLError):
    pass


class _SecondDocument(yaml.MarkedYAMLError):
    pass


class _TextLoader(yaml.BaseLoader):
    """PyYAML's BaseLoader (no implicit types) with duplicate keys refused."""

    def construct_scalar(self, node: ScalarNode) -> Any:
        text = node.value
        if node.style is None:
            return None if text in _NULLS else Plain(text)
        return str(text)

    def construct_mapping(self, node: MappingNode, deep: bool = False) -> dict[Any, Any]:
        first: dict[object, int] = {}
        for key_node, _ in node.value:
            key = self.construct_object(key_node)
            line = key_node.start_mark.line + 1
            if isinstance(key, str) and key in first:
                raise _DuplicateKey(
                    problem=f"duplicate key '{key}' (first on line {first[key]})",
                    problem_mark=key_node.start_mark,
                )
            if isinstance(key, str):
                first[key] = line
        return super().construct_mapping(node, deep)


def read_text_yaml(text: str, source: str) -> Any:
    """``text``'s first YAML document parsed with scalars as text; ConfigUnreadable naming
    line and column if not.

    envoyproxy/ratelimit (yaml.v2's Unmarshal) reads the first document of a file, so a file
    that ends in ``---`` loads there, and here; an empty document after it is fine. A second
    document with content is ignored there without a word: here it is refused, naming its
    line, since a domain dropped silently leaves its traffic unlimited."""
    try:
        loader = _TextLoader(text)  # the reader refuses a control character at once
    except yaml.YAMLError as exc:
        raise unreadable(exc, source) from exc
    try:
        first = loader.get_node() if loader.check_node() else None
        data = None if first is None else loader.construct_document(first)
        while loader.check_node():
            node = loader.get_node()
            empty = isinstance(node, ScalarNode) and node.style is None and node.value in _NULLS
            if node is not None and not empty:
                raise _SecondDocument(
                    problem="envoyproxy/ratelimit reads only a file's first document and "
                    "ignores this one: put each domain in its own file",
                    problem_mark=node.start_mark,
                )
        return data
    except yaml.YAMLError as exc:
        raise unreadable(exc, source) from exc
    finally:
        loader.dispose()


def unreadable(exc: yaml.YAMLError, source: str) -> ConfigUnreadable:
    """PyYAML's error as ours: ``source``, line and column where PyYAML marks one, reason."""
    mark = getattr(exc, "problem_mark", None)
    where = f"line {mark.line + 1} column {mark.column + 1}" if mark else "(file)"
    reason = getattr(exc, "problem", None) or str(exc)
    what = "invalid YAML"
    if isinstance(exc, _SecondDocument):
        what = "a second YAML document"
    elif isinstance(exc, _DuplicateKey):
        what = "duplicate key"
    if isinstance(exc, _DuplicateKey):
        reason = reason.removeprefix("duplicate key ")
    return ConfigUnreadable([f"{source}: {where}: {what}: {reason}"])


def as_bool(value: object) -> bool | None:
    """A YAML 1.1 boolean written as a plain scalar (as Go's yaml.v2 reads one), else None."""
    if isinstance(value, Plain):
        if value in _TRUE:
            return True
        if value in _FALSE:
            return False
    return None


def as_int(value: object) -> int | None:
    """A plain decimal integer without a leading zero, else None.

    ``010`` is refused rather than guessed: upstream reads it as octal 8 in a number field.
    """
    if not isinstance(value, Plain):
        return None
    digits = value.removeprefix("+")
    if not digits.isascii() or not digits.isdigit() or (len(digits) > 1 and digits[0] == "0"):
        return None
    return int(digits)


def as_number(value: object) -> float | None:
    """A plain decimal number (``3``, ``0.5``), else None."""
    if isinstance(value, Plain) and _DECIMAL.fullmatch(value):
        return float(value)
    return None


def typed(value: object) -> Any:
    """``value`` with plain scalars typed as YAML 1.1 types them (for ``metadata``)."""
    if isinstance(value, dict):
        return {str(k): typed(v) for k, v in value.items()}
    if isinstance(value, list):
        return [typed(v) for v in value]
    if isinstance(value, Plain):
        loaded = yaml.safe_load(value)
        # dates and the like have no JSON form (metadata becomes a protobuf Struct): text
        return loaded if loaded is None or isinstance(loaded, str | int | float) else str(value)
    return value
