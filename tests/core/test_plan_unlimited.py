"""An unlimited descriptor's plan (core/plan): nothing charged, its rule still named, so
its status is never a quota one, even when every rule counts as quota (QUOTA_MODE)."""

from pathlib import Path

import pytest

from fairlimit.core.admission import Code, Outcome, is_quota, overall, statuses
from fairlimit.core.matching import Matcher
from fairlimit.core.plan import plan
from helpers import desc, load_text, req

pytestmark = pytest.mark.unit

CONFIG = """
domain: d
descriptors:
  - key: internal
    rate_limit: {unlimited: true}
  - key: user
    rate_limit: {unit: second, requests_per_unit: 1}
"""


class TestUnlimited:
    def test_the_plan_names_the_rule_and_charges_nothing(self, tmp_path: Path) -> None:
        matcher = Matcher(load_text(tmp_path, CONFIG).config)
        (dplan,) = plan(req("d", desc("internal=x")), matcher).descriptors
        assert (dplan.unlimited, dplan.charges) == (True, ())
        assert dplan.rule is not None and dplan.rule.path == "d/internal"

    def test_never_a_quota_descriptor(self, tmp_path: Path) -> None:
        """Every rule counts as quota: user over its limit alone is every quota descriptor
        over, so the request is over (the unlimited one does not count as an OK quota)."""
        matcher = Matcher(load_text(tmp_path, CONFIG).config)
        built = plan(req("d", desc("internal=x"), desc("user=u")), matcher)
        found = statuses(built, Outcome(False, (1,), (), ()), 0.0)
        assert not is_quota(found[0], quota_all=True)
        assert [s.code for s in found] == [Code.OK, Code.OVER_LIMIT]
        assert overall(found, quota_all=True) is Code.OVER_LIMIT
