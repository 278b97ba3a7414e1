"""The bounds a request must keep (core/request.py): each refusal, its message and its edge."""

import pytest
from hypothesis import given
from hypothesis import strategies as st

from fairlimit.core.request import (
    MAX_DESCRIPTORS,
    MAX_ENTRIES,
    MAX_HITS,
    Descriptor,
    Request,
    validate,
)
from fairlimit.core.values import MAX_TEXT, STAND_IN_EDGE, bounded_value, stand_in
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
        """A key and a value of MAX_TEXT characters pass; one more of either is refused (a
        value from the wire never is: it is bounded first, below)."""
        validate(_one(Descriptor((("k" * MAX_TEXT, "v" * MAX_TEXT),))))
        long_key = _one(Descriptor((("k" * (MAX_TEXT + 1), "v"),)))
        assert _refusal(long_key) == f"descriptor 0 has an entry key longer than {MAX_TEXT}"
        long_value = _one(Descriptor((("k", "v" * (MAX_TEXT + 1)),)))
        assert _refusal(long_value) == f"descriptor 0 has an entry value longer than {MAX_TEXT}"

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


long_texts = st.text(min_size=MAX_TEXT + 1, max_size=4 * MAX_TEXT)


class TestStandIn:
    """A value too long or no UTF-8 is counted as its stand-in, which must keep distinct
    values apart, fit the bounds, and keep both ends for wildcard values."""

    def test_a_value_within_the_bound_is_itself(self) -> None:
        value = "é" * MAX_TEXT
        assert bounded_value(value) is value

    @given(long_texts)
    def test_a_long_value_fits_and_keeps_both_ends(self, value: str) -> None:
        bounded = bounded_value(value)
        assert len(bounded) <= MAX_TEXT
        assert bounded.startswith(value[:STAND_IN_EDGE])
        assert bounded.endswith(value[-STAND_IN_EDGE:])
        validate(_one(Descriptor((("k", bounded),))))
        assert bounded_value(value) == bounded  # the same in every process: no seed

    @given(long_texts, st.integers(STAND_IN_EDGE, MAX_TEXT), st.characters())
    def test_long_values_differing_in_the_middle_stay_apart(
        self, value: str, at: int, other: str
    ) -> None:
        changed = value[:at] + other + value[at + 1 :]
        if changed != value:
            assert bounded_value(changed) != bounded_value(value)

    @given(st.binary(max_size=3 * MAX_TEXT))
    def test_any_bytes_get_a_stand_in_within_the_bounds(self, raw: bytes) -> None:
        text = stand_in(raw)
        assert len(text) <= MAX_TEXT
        text.encode("utf-8")  # a Redis key, a log line, a label: UTF-8 throughout
        assert stand_in(raw + b"\xff") != text

    def test_bytes_that_are_no_utf8_keep_their_readable_part(self) -> None:
        text = stand_in(b"alice\xff")
        assert text.startswith("alice\ufffd") and text.endswith("alice\ufffd")
