"""The bounds a request must keep (core/request.py): each refusal, its message and its edge."""

import pytest

from fairlimit.core.request import (
    MAX_DESCRIPTORS,
    MAX_ENTRIES,
    MAX_HITS,
    MAX_TEXT,
    Descriptor,
    Request,
    validate,
)
from fairlimit.errors import RequestError

pytestmark = pytest.mark.unit


def _refusal(request: Request) -> str:
    with pytest.raises(RequestError) as caught:
        validate(request)
    return str(caught.value)


def _one(descriptor: Descriptor) -> Request:
    return Request("d", (descriptor,))


class TestRefusals:
    def test_an_empty_domain(self) -> None:
        assert _refusal(Request("", (Descriptor((("k", "v"),)),))) == (
            "rate limit domain must not be empty"
        )

    def test_no_descriptors(self) -> None:
        assert _refusal(Request("d", ())) == "rate limit descriptor list must not be empty"

    def test_a_descriptor_without_entries(self) -> None:
        assert _refusal(_one(Descriptor(()))) == "descriptor 0 has no entries"

    def test_an_entry_with_an_empty_key(self) -> None:
        descriptor = Descriptor((("k", "v"), ("", "v")))
        assert _refusal(_one(descriptor)) == "descriptor 0 has an entry with an empty key"


class TestEdges:
    def test_entries_up_to_the_maximum(self) -> None:
        """MAX_ENTRIES entries pass; one more is refused, naming the bound."""
        entries = tuple((f"k{i}", "v") for i in range(MAX_ENTRIES))
        validate(_one(Descriptor(entries)))
        too_many = _one(Descriptor((*entries, ("k", "v"))))
        assert _refusal(too_many) == f"descriptor 0 has more than {MAX_ENTRIES} entries"

    def test_text_up_to_the_maximum(self) -> None:
        """A value of MAX_TEXT characters passes; one more is refused."""
        validate(_one(Descriptor((("k", "v" * MAX_TEXT),))))
        long = _one(Descriptor((("k", "v" * (MAX_TEXT + 1)),)))
        assert _refusal(long) == f"descriptor 0 has an entry longer than {MAX_TEXT}"

    def test_descriptor_hits_up_to_the_maximum(self) -> None:
        """A descriptor's hits_addend of MAX_HITS passes; one more is refused."""
        validate(_one(Descriptor((("k", "v"),), hits=MAX_HITS)))
        over = _one(Descriptor((("k", "v"),), hits=MAX_HITS + 1))
        assert _refusal(over) == f"descriptor 0 hits_addend above {MAX_HITS}"

    def test_descriptors_up_to_the_maximum(self) -> None:
        """MAX_DESCRIPTORS descriptors pass; one more is refused, naming the bound."""
        one = Descriptor((("k", "v"),))
        validate(Request("d", (one,) * MAX_DESCRIPTORS))
        too_many = Request("d", (one,) * (MAX_DESCRIPTORS + 1))
        assert _refusal(too_many) == f"at most {MAX_DESCRIPTORS} descriptors per request"

    def test_domain_and_request_hits_up_to_the_maximum(self) -> None:
        """A MAX_TEXT domain and a MAX_HITS hits_addend pass; one more of either is refused."""
        one = (Descriptor((("k", "v"),)),)
        validate(Request("d" * MAX_TEXT, one, hits=MAX_HITS))
        message = f"domain longer than {MAX_TEXT} or hits_addend above {MAX_HITS}"
        assert _refusal(Request("d" * (MAX_TEXT + 1), one)) == message
        assert _refusal(Request("d", one, hits=MAX_HITS + 1)) == message
