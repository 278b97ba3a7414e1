"""A rate-limit request free of the wire format, and the bounds it must keep."""

from dataclasses import dataclass

from fairlimit.core.matching import Entry
from fairlimit.core.rules import RateLimit
from fairlimit.core.values import MAX_TEXT
from fairlimit.errors import RequestError

MAX_DESCRIPTORS = 64
MAX_ENTRIES = 16
MAX_HITS = 0xFFFFFFFF


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
