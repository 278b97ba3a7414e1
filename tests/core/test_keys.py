"""Counter and cap keys (core/keys.py): built and parsed in one place."""

import pytest
from hypothesis import given
from hypothesis import strategies as st

from fairlimit.core.keys import (
    counter_key,
    escape,
    key_path,
    key_paths,
    parse_counter_key,
)
from oracles import descriptor_key
from strategies import descriptor_keys

pytestmark = pytest.mark.unit

Parts = tuple[str, list[tuple[str, str]], int]


class TestBuild:
    def test_a_key_is_the_escaped_path_and_the_window(self) -> None:
        """domain/key=value/...#window, with backslash, slash and equals escaped."""
        key = descriptor_key("api", [("route", "a/b"), ("user", "x=y\\z")], 60)
        assert key == "api/route=a\\/b/user=x\\=y\\\\z#60"

    def test_plain_text_is_not_copied(self) -> None:
        """Text with nothing to escape comes back as the same object (the hot path)."""
        text = "".join(["client", "-7"])
        assert escape(text) is text

    def test_each_prefix_has_its_path(self) -> None:
        """A cap's key is the key of a prefix of its clients' descriptor."""
        paths = key_paths("api", [("tenant", "acme"), ("user", "u1")])
        assert paths == ["api/tenant=acme", "api/tenant=acme/user=u1"]
        assert counter_key(paths[0], 1) == descriptor_key("api", [("tenant", "acme")], 1)

    def test_no_entries_is_the_domain_alone(self) -> None:
        """A descriptor without entries keys on its domain."""
        assert descriptor_key("a/b", [], 5) == "a\\/b#5"


class TestSharedPaths:
    def test_a_shared_value_is_its_pattern_marked_by_an_escaped_star(self) -> None:
        """share_threshold: the entry's value becomes \\* and its escaped pattern, in its domain."""
        paths = key_paths("api", [("path", "/static/a.css"), ("op", "get")], [(0, "/static/*")])
        assert paths == ["api/path=\\*\\/static\\/*", "api/path=\\*\\/static\\/*/op=get"]

    def test_entries_not_named_keep_their_value(self) -> None:
        """Only the entries named by index share; the others key on their own value."""
        paths = key_paths("a/b", [("k", "v"), ("path", "/x/1")], [(1, "/x/*")])
        assert paths == ["a\\/b/k=v", "a\\/b/k=v/path=\\*\\/x\\/*"]


class TestParse:
    @given(descriptor_keys())
    def test_keys_parse_back(self, parts: Parts) -> None:
        """parse_counter_key inverts descriptor_key, whatever the text holds."""
        domain, entries, window = parts
        assert parse_counter_key(descriptor_key(domain, entries, window)) == (
            domain,
            tuple(entries),
        )

    @given(descriptor_keys())
    def test_key_path_is_the_last_prefix_path(self, parts: Parts) -> None:
        """key_path drops exactly the ``#window`` that counter_key added."""
        domain, entries, window = parts
        paths = key_paths(domain, entries) or [escape(domain)]
        assert key_path(descriptor_key(domain, entries, window)) == paths[-1]

    def test_text_that_is_not_a_key_parses_to_none(self) -> None:
        """No window, a window that is not a number, or an entry without '=' is no key."""
        for text in ("api/a=b", "api/a=b#x", "api/a#5", "api/a=b=c#5"):
            assert parse_counter_key(text) is None

    @given(st.text())
    def test_any_text_parses_without_raising(self, text: str) -> None:
        """Keys read back from a store may be any text: the answer is a key or None."""
        parsed = parse_counter_key(text + "#1")
        assert parsed is None or isinstance(parsed[0], str)

    def test_a_dangling_backslash_escapes_nothing(self) -> None:
        """A backslash ending the path adds nothing to the last value."""
        assert parse_counter_key("api/a=b\\#5") == ("api", (("a", "b"),))

    def test_key_path_of_text_without_a_window_is_the_text(self) -> None:
        """A key without '#' is its own path (the hash tag of any key is defined)."""
        assert key_path("api/a=b") == "api/a=b"
