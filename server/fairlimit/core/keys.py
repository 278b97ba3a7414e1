"""Counter and cap keys: built and parsed here and nowhere else.

A key is the descriptor's path and its window: ``domain/k1=v1/k2=v2#60``. Keys and values
are escaped (``\\``, ``/`` and ``=`` get a backslash) so that two descriptors never share a
path. A cap's key is the key of a prefix of its clients' descriptors, so every key of one
descriptor comes from one walk over its entries (``key_paths``).
"""

from collections.abc import Sequence

from fairlimit.core.matching import Entry
from fairlimit.core.units import Shape


def escape(part: str) -> str:
    """Escape a domain, key or value so that joined paths never collide."""
    if "\\" in part or "/" in part or "=" in part:
        return part.replace("\\", "\\\\").replace("/", "\\/").replace("=", "\\=")
    return part  # the common case: nothing to escape, no new string


def key_paths(
    domain: str, entries: Sequence[Entry], shared: Sequence[tuple[int, str]] = ()
) -> list[str]:
    """The key paths of ``entries[:1]``, ``entries[:2]``, ... (a counter key less ``#window``).

    ``shared`` names entries (by index) whose value is replaced by their share_threshold
    pattern, marked ``\\*``: escaping never writes a backslash before ``*``, so no request
    value can produce the shared key.
    """
    if shared:
        return _shared_paths(domain, entries, dict(shared))
    path = escape(domain)
    out: list[str] = []
    for k, v in entries:
        path = f"{path}/{escape(k)}={escape(v)}"
        out.append(path)
    return out


def _shared_paths(domain: str, entries: Sequence[Entry], patterns: dict[int, str]) -> list[str]:
    path = escape(domain)
    out: list[str] = []
    for index, (k, v) in enumerate(entries):
        pattern = patterns.get(index)
        value = escape(v) if pattern is None else "\\*" + escape(pattern)
        path = f"{path}/{escape(k)}={value}"
        out.append(path)
    return out


def counter_key(path: str, window: int, shape: Shape | None = None) -> str:
    """The store key of the counter at ``path`` (from ``key_paths``) for a window in seconds,
    counted as ``shape`` says (its tag follows the window: ``#60s``, ``#604800@UTC``)."""
    if shape is None:
        return f"{path}#{window}"
    return f"{path}#{window}{shape.tag}"


def key_path(key: str) -> str:
    """The path of a counter key (the part before ``#window``); the key itself if it has none."""
    return key.rpartition("#")[0] or key


def parse_counter_key(key: str) -> tuple[str, tuple[Entry, ...]] | None:
    """(domain, entries) of the counter key of a whole descriptor; None for any other text."""
    body, sep, window = key.rpartition("#")
    if not sep or not window.isdigit():
        return None
    segments: list[list[str]] = [[""]]  # split on unescaped '/', then on unescaped '='
    chars = iter(body)
    for char in chars:
        if char == "\\":
            segments[-1][-1] += next(chars, "")
        elif char == "/":
            segments.append([""])
        elif char == "=":
            segments[-1].append("")
        else:
            segments[-1][-1] += char
    if len(segments[0]) != 1 or any(len(s) != 2 for s in segments[1:]):
        return None
    return segments[0][0], tuple((s[0], s[1]) for s in segments[1:])
