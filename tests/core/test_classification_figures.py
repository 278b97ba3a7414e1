"""The figures behind a cap's classification (core/validation.py), not only its message."""

from pathlib import Path

import pytest

from fairlimit.core.validation import Classification, most_severe
from helpers import load_text
from limit_configs import CAP_OF_TWO

pytestmark = pytest.mark.unit


def _cap(tmp_path: Path, active: int, children: str) -> Classification:
    text = f"""
domain: d
descriptors:
  - key: tenant
    value: t
    rate_limit: {{unit: second, requests_per_unit: 100}}
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
