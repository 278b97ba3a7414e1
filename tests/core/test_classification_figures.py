"""The figures behind a cap's classification (core/validation.py), not only its message."""

from pathlib import Path

import pytest

from fairlimit.core.validation import Classification, most_severe
from helpers import load_text
from limit_configs import CAP_OF_TWO

pytestmark = pytest.mark.unit


def _cap(tmp_path: Path, active: int, children: str, cap: str = "minute, requests_per_unit: 6000"
         ) -> Classification:  # fmt: skip
    """The classification of a cap of 100/s (by default counted per minute, so that its
    children's per-minute limits are rates within its window)."""
    text = f"""
domain: d
descriptors:
  - key: tenant
    value: t
    rate_limit: {{unit: {cap}}}
    fair_share: {{active_clients: {active}}}
    descriptors:
{children}
"""
    (found,) = load_text(tmp_path, text).classifications
    return found


NAMED = """      - key: user
        value: a
        rate_limit: {unit: second, requests_per_unit: 30}
      - key: user
        value: b
        rate_limit: {unit: second, requests_per_unit: 20}"""
OPEN = """      - key: user
        rate_limit: {unit: minute, requests_per_unit: %d}"""


class TestFigures:
    def test_as_many_active_as_named_is_the_named_sum(self, tmp_path: Path) -> None:
        """Two named clients, two active: the largest 2 of 2, with no per-client figure."""
        found = _cap(tmp_path, 2, NAMED)
        assert (found.required_per_second, found.per_client_per_second) == (50.0, None)
        assert "(largest 2 of 2 named clients)" in found.message

    def test_few_active_keep_the_open_clients_rate(self, tmp_path: Path) -> None:
        """Two active of two named and any others: the named sum, 10/s a client still."""
        found = _cap(tmp_path, 2, NAMED + "\n" + OPEN % 600)
        assert (found.required_per_second, found.per_client_per_second) == (50.0, 10.0)

    def test_open_clients_carry_their_per_client_rate(self, tmp_path: Path) -> None:
        """The value-less child's rate is the per-client figure, and the cap its own."""
        found = _cap(tmp_path, 4, OPEN % 600)
        assert (found.cap_per_second, found.per_client_per_second) == (100.0, 10.0)
        assert found.required_per_second == 40.0

    def test_named_and_open_clients_carry_the_per_client_rate(self, tmp_path: Path) -> None:
        """2 named (50/s) + 2 others at 10/s: 70/s, 10/s a client."""
        found = _cap(tmp_path, 4, NAMED + "\n" + OPEN % 600)
        assert (found.required_per_second, found.per_client_per_second) == (70.0, 10.0)

    def test_a_slow_open_client_still_counts(self, tmp_path: Path) -> None:
        """30 a minute is 0.5/s a client: 3 clients need 1.5/s."""
        assert _cap(tmp_path, 3, OPEN % 30).required_per_second == 1.5

    def test_a_zero_open_client_needs_nothing(self, tmp_path: Path) -> None:
        assert _cap(tmp_path, 3, OPEN % 0).required_per_second == 0.0

    def test_a_limit_of_a_longer_window_counts_whole_in_the_caps(self, tmp_path: Path) -> None:
        """600 a minute under a per-second cap may be spent in one second: 600/s a client,
        not its average 10/s, and the message says so (issue 37)."""
        found = _cap(tmp_path, 4, OPEN % 600, cap="second, requests_per_unit: 100")
        assert (found.required_per_second, found.per_client_per_second) == (2400.0, 600.0)
        assert found.is_warning
        assert found.message.endswith(
            "(600/s x 4 active clients; a client may spend its 600 per minute in one 1s window"
            " of the cap, 10/s on average): contention shifts to the cap"
        )

    def test_a_shorter_limit_beside_a_longer_one_sets_the_rate(self, tmp_path: Path) -> None:
        """30/s and 1000 a minute under a per-second cap: 30/s a client (the minute's 1000
        cannot all come in one second), and no word of spending it at once."""
        both = """      - key: user
        rate_limits:
          - {unit: second, requests_per_unit: 30}
          - {unit: minute, requests_per_unit: 1000}"""
        found = _cap(tmp_path, 3, both, cap="second, requests_per_unit: 100")
        assert (found.required_per_second, found.per_client_per_second) == (90.0, 30.0)
        assert "at once" not in found.message and "in one" not in found.message


SEVERAL = (
    """
domain: d
descriptors:
"""
    + CAP_OF_TWO
    + """  - key: route
    value: public
    rate_limits:
      - {unit: second, requests_per_unit: 10}
      - {unit: minute, requests_per_unit: 100}
"""
)


class TestWhichLimit:
    def test_a_cap_names_the_limit_each_verdict_is_about(self, tmp_path: Path) -> None:
        """One verdict per limit of a cap, each with its index; a bucket's is the rule's."""
        cap_first, cap_second, bucket = load_text(tmp_path, SEVERAL).classifications
        assert (cap_first.limit, cap_first.cap_per_second, cap_first.is_warning) == (0, 100, False)
        assert (cap_second.limit, cap_second.cap_per_second, cap_second.is_warning) == (1, 10, True)
        assert (bucket.path, bucket.limit) == ("d/route=public", None)

    def test_the_most_severe_verdict_is_a_warning_else_the_first(self, tmp_path: Path) -> None:
        cap_first, cap_second, bucket = load_text(tmp_path, SEVERAL).classifications
        assert most_severe([cap_first, cap_second]) is cap_second
        assert most_severe([cap_second, cap_first]) is cap_second
        assert most_severe([cap_first]) is cap_first
        assert most_severe([bucket]) is bucket
