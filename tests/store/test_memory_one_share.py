"""The memory store's path for a plan with one share (store/capped.py's ``admit_one`` and
``MemoryCaps.claim``, the common case of each step inlined) decides exactly as its general
path for plans with shares (``admit_many``, ``MemoryCaps.claims``): the same outcomes, the
same rows, the same division, over random call sequences on an injected clock."""

from dataclasses import dataclass
from pathlib import Path

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from fairlimit.core.matching import Matcher
from fairlimit.core.plan import Plan, plan
from fairlimit.core.sharing import DIVISION_FIELDS, ROW_FIELDS
from fairlimit.store.capped import admit_many
from fairlimit.store.memory import MemoryStore
from fairness_cases import flat_config
from helpers import FakeClock, desc, load_text, req

pytestmark = pytest.mark.unit


class GeneralStore(MemoryStore):
    """The memory store with every plan with shares on the general path."""

    one_share = staticmethod(admit_many)


@dataclass(frozen=True)
class Call:
    client: int
    hits: int | None
    after: float  # seconds since the call before


calls = st.lists(
    st.builds(
        Call,
        st.integers(0, 5),
        st.one_of(st.none(), st.integers(0, 4)),
        # mostly within a sub-period, sometimes across periods and windows
        st.one_of(
            st.sampled_from([0.0, 0.001, 0.01, 0.05, 0.1, 0.26, 0.5, 1.0]),
            st.floats(0.0, 3.0, allow_nan=False),
        ),
    ),
    min_size=1,
    max_size=120,
)
configs = st.tuples(
    st.integers(1, 40),  # the cap's capacity
    st.sampled_from(["second", "minute"]),
    st.integers(1, 30),  # a client's own limit
    st.integers(1, 8),  # active_clients
    st.sampled_from(["", "second", "minute"]),  # the clients' unit (the cap's when "")
)


def _state(store: MemoryStore) -> list[object]:
    """Every cap's rows and division, field by field."""
    out: list[object] = []
    for key, cap in sorted(store.fair.table.items()):
        division = cap.division
        out.append((key, cap.period, cap.last_seen))
        out.append(None if division is None else [getattr(division, f) for f in DIVISION_FIELDS])
        out.append((cap.light.window, cap.light.asked, cap.light.expected, cap.light.calendar))
        for client, row in sorted(cap.rows.items()):
            out.append((client, [getattr(row, f) for f in ROW_FIELDS]))
    return out


class TestOneShareSameAsGeneral:
    @settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.too_slow,
              HealthCheck.function_scoped_fixture])  # fmt: skip
    @given(config=configs, sequence=calls)
    def test_the_one_share_path_decides_as_the_general_path(
        self, tmp_path: Path, config: tuple[int, str, int, int, str], sequence: list[Call]
    ) -> None:
        """Same outcome per call, and the same rows and division after it, as the path
        every plan with several shares takes."""
        capacity, unit, limit, active, client_unit = config
        yaml = flat_config(capacity, unit, limit, active, client_unit)
        matcher = Matcher(load_text(tmp_path, yaml).config)
        plans: dict[tuple[int, int | None], Plan] = {}
        one, general = MemoryStore(), GeneralStore()
        clock = FakeClock(1_700_000_000.25)
        for step, call in enumerate(sequence):
            clock.advance(call.after)
            key = (call.client, call.hits)
            if key not in plans:
                entries = ("route=api", f"client_id=c{call.client}")
                plans[key] = plan(req("fair", desc(*entries, hits=call.hits)), matcher)
            built = plans[key]
            assert len(built.shares) == 1
            got = one.admit_now(built, clock.now())
            want = general.admit_now(built, clock.now())
            assert got == want, f"call {step}: {call}"
            assert _state(one) == _state(general), f"after call {step}: {call}"
