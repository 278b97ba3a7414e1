"""A rate-limit request free of the wire format, and the bounds it must keep."""

import hashlib
from dataclasses import dataclass

from fairlimit.core.matching import Entry
from fairlimit.core.rules import RateLimit
from fairlimit.errors import RequestError

MAX_DESCRIPTORS = 64
MAX_ENTRIES = 16
MAX_TEXT = 1024
MAX_HITS = 0xFFFFFFFF
# A descriptor's value is what the request carried (a header, a path, a claim), so its
# client chooses it; the domain and the keys are Envoy's configuration. A value longer than
# MAX_TEXT, or bytes that are no UTF-8, is matched and counted as its stand-in, not refused:
# Envoy lets the request of a refused call through (failure_mode_deny: false), so a refusal
# would let any client past every limit with one long or broken header.
STAND_IN_EDGE = 448  # the characters of each end a stand-in keeps (969 characters in all)


# Built on every request, so slotted but not frozen: a frozen dataclass's __init__ sets each
# field through object.__setattr__, about five times the cost. Nothing changes one after it
# is built.
@dataclass(slots=True)
class Descriptor:
    """One request descriptor: its entries, an optional limit override and hits."""

    entries: tuple[Entry, ...]
    limit: RateLimit | None = None
    hits: int | None = None
    negative: bool = False  # is_negative_hits: hits given back, never charged (core/reserve)


@dataclass(slots=True)  # not frozen: built per request (see Descriptor)
class Request:
    """A ShouldRateLimit request, free of the wire format."""

    domain: str
    descriptors: tuple[Descriptor, ...]
    hits: int = 0  # request-level hits_addend; 0 means 1

    def hits_for(self, descriptor: Descriptor) -> int:
        if descriptor.hits is not None:
            return descriptor.hits
        return self.hits or 1


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


def too_many_descriptors() -> RequestError:
    """The refusal of a request past MAX_DESCRIPTORS (also raised before conversion)."""
    return RequestError(f"at most {MAX_DESCRIPTORS} descriptors per request")


def validate(request: Request) -> None:
    """Reject requests no Envoy would send, or that would abuse the server (RequestError)."""
    if not request.domain:
        raise RequestError("rate limit domain must not be empty")
    if not request.descriptors:
        raise RequestError("rate limit descriptor list must not be empty")
    if len(request.descriptors) > MAX_DESCRIPTORS:
        raise too_many_descriptors()
    if len(request.domain) > MAX_TEXT or request.hits > MAX_HITS:
        raise RequestError(f"domain longer than {MAX_TEXT} or hits_addend above {MAX_HITS}")
    for index, descriptor in enumerate(request.descriptors):
        _validate_descriptor(index, descriptor)


def _validate_descriptor(index: int, descriptor: Descriptor) -> None:
    entries = descriptor.entries
    if not entries or len(entries) > MAX_ENTRIES:
        raise RequestError(
            f"descriptor {index} has no entries"
            if not entries
            else f"descriptor {index} has more than {MAX_ENTRIES} entries"
        )
    if max([len(k) for k, _ in entries]) > MAX_TEXT:
        raise RequestError(f"descriptor {index} has an entry key longer than {MAX_TEXT}")
    if max([len(v) for _, v in entries]) > MAX_TEXT:  # the wire's are bounded_value()'s
        raise RequestError(f"descriptor {index} has an entry value longer than {MAX_TEXT}")
    if not all([k for k, _ in entries]):
        raise RequestError(f"descriptor {index} has an entry with an empty key")
    if descriptor.hits is not None and descriptor.hits > MAX_HITS:
        raise RequestError(f"descriptor {index} hits_addend above {MAX_HITS}")
