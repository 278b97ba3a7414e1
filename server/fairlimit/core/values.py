"""A descriptor's values as they are matched and counted: within MAX_TEXT characters.

A descriptor's value is what the request carried (a header, a path, a claim), so its
client chooses it; the domain and the keys are Envoy's configuration. A value longer than
MAX_TEXT, or bytes that are no UTF-8, is matched and counted as its stand-in, not refused:
Envoy lets the request of a refused call through (failure_mode_deny: false), so a refusal
would let any client past every limit with one long or broken header. A configuration's
exact value longer than MAX_TEXT is matched as its stand-in too (core/matching.py): it
matches the requests that carry it, as it would in envoyproxy/ratelimit.
"""

import hashlib

MAX_TEXT = 1024
STAND_IN_EDGE = 448  # the characters of each end a stand-in keeps (969 characters in all)


def stand_in(raw: bytes) -> str:
    """What a value of ``raw`` bytes that is too long or no UTF-8 is matched and counted as:
    its first and last STAND_IN_EDGE characters (a byte that is no UTF-8 as U+FFFD) around
    the SHA-256 of all its bytes. Distinct values keep distinct counters of bounded size,
    the same value the same counter in every replica, and a wildcard value (``/api/*``,
    ``*.jpg``) matches it as it would the value when its fixed text lies within each end."""
    text = raw.decode("utf-8", "replace")
    digest = hashlib.sha256(raw).hexdigest()
    return f"{text[:STAND_IN_EDGE]}\u2026sha256:{digest}\u2026{text[-STAND_IN_EDGE:]}"


def bounded_value(value: str) -> str:
    """``value`` itself, or its stand-in when it is longer than MAX_TEXT."""
    if len(value) <= MAX_TEXT:
        return value
    return stand_in(value.encode("utf-8", "surrogatepass"))
