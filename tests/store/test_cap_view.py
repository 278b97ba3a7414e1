"""A concurrency cap's state assembled from acquire.lua's parts (store/redis/cap_view.py),
fed parts as the script hands them back: the pass rules without a Redis (the Redis tests in
test_redis_slots_at_scale.py feed it real ones)."""

import pytest

from fairlimit.core.concurrency import CapDemand
from fairlimit.store.redis.cap_view import WHOLE, CapView, HashView

pytestmark = pytest.mark.unit

ME = ("me", 4.0, 1.0)  # the asking client: name, its own limit, its weight


def _rows(*clients: tuple[str, str, int]) -> list[str]:
    """Flat fields of clients (name, prefix n: or r:, count) at limit 4, weight 1."""
    out: list[str] = []
    for name, prefix, count in clients:
        out += [f"{prefix}{name}", str(count), f"l:{name}", "4.0", f"w:{name}", "1.0"]
    return out


def _state(held: tuple[str, list[str]], want: tuple[str, str, list[str]],
           own: tuple[str | None, str | None] = (None, None)) -> list[object]:  # fmt: skip
    """A states entry without its index: held (cursor, part), want (stamp, cursor, part)."""
    return [held[0], held[1], want[0], want[1], want[2], *own]


class TestHashView:
    def test_a_whole_part_replaces_what_was_read(self) -> None:
        """A hash handed back whole is the view, whatever the passes read before."""
        view = HashView()
        view.take("0", "7", _rows(("a", "n:", 1), ("b", "n:", 2)))
        assert view.take("7", WHOLE, _rows(("a", "n:", 3))) == {"a", "b"}
        assert view.fields == {"n:a": "3", "l:a": "4.0", "w:a": "1.0"}
        assert view.cursor == "0"

    def test_a_field_a_complete_pass_did_not_find_is_dropped_at_its_end(self) -> None:
        """a and b read by a pass; the next pass finds a only: b stays until it ends."""
        view = HashView()
        view.take("0", "5", _rows(("a", "n:", 1)))
        view.take("5", "0", _rows(("b", "n:", 1)))
        view.take("0", "5", _rows(("a", "n:", 1)))
        assert "n:b" in view.fields
        assert view.take("5", "0", []) == {"b"}
        assert set(view.fields) == {"n:a", "l:a", "w:a"}

    def test_a_part_of_an_earlier_cursor_gives_its_fields_and_leaves_the_cursor(self) -> None:
        """Two calls sent from cursor 0: the second part's fields are taken, and the pass goes
        on from where the first one left it, not ended by the second's 0."""
        view = HashView()
        view.take("0", "5", _rows(("a", "n:", 1)))
        view.take("0", "0", _rows(("b", "n:", 1)))
        assert view.cursor == "5" and {"n:a", "n:b"} <= set(view.fields)


class TestCapView:
    def test_a_newer_want_hash_starts_the_want_afresh_and_an_older_is_left_out(self) -> None:
        """Refusals of want stamp 10 are gone when a part of stamp 20 comes; a later part
        of stamp 10 (a call sent before) changes nothing of want."""
        view = CapView(0.0, lambda c: 1.0)
        view.take(0.0, ("0", "0", ""), _state(("", []), ("10", "", _rows(("x", "r:", 2)))), ME)
        assert view.clients["x"] == CapDemand(0, 2, 4.0, 1.0)
        view.take(0.1, ("0", "0", "10"), _state(("", []), ("20", "", _rows(("y", "r:", 1)))), ME)
        assert set(view.clients) == {"y"} and view.stamp == "20"
        view.take(0.2, ("0", "0", "10"), _state(("", []), ("10", "", _rows(("x", "r:", 5)))), ME)
        assert set(view.clients) == {"y"}

    def test_the_askers_own_counts_are_as_the_call_read_them(self) -> None:
        """The asker's n: and r: from the call count, its limit and weight its own; none
        of either and it is not a client of the cap."""
        view = CapView(0.0, lambda c: 1.0)
        view.take(0.0, ("0", "0", ""), _state(("", []), ("10", "", []), ("2", "1")), ME)
        assert view.clients["me"] == CapDemand(2, 1, 4.0, 1.0)
        view.take(0.1, view.reads(), _state(("", []), ("10", "", []), (None, None)), ME)
        assert "me" not in view.clients

    def test_a_client_read_before_its_terms_takes_the_caps_weight_and_no_limit(self) -> None:
        """A part with z's r: but not yet its l: and w: (another bucket): z counts, at the
        cap's weight for it and without a limit of its own, until they are read."""
        view = CapView(0.0, lambda c: 3.0 if c == "z" else 1.0)
        view.take(0.0, ("0", "0", ""), _state(("", []), ("10", "9", ["r:z", "2"])), ME)
        assert view.clients["z"] == CapDemand(0, 2, float("inf"), 3.0)
        view.take(0.1, view.reads(), _state(("", []), ("10", "0", ["l:z", "2.0", "w:z", "3.0"])),
                  ME)  # fmt: skip
        assert view.clients["z"] == CapDemand(0, 2, 2.0, 3.0)
