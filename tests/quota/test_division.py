"""The RLQS division in arrays (quota/division.py) against its reference, core/quota.py's
``allocate``, and each cap's level against the exact max-min solver (tests/support/maxmin.py).

Random holders: up to three caps (capacities, client limits and weights random), buckets
under one or two of them or none (own limit only), a few blanket ones, clients spread over
several buckets, one to three Envoys per bucket, demands unmeasured, idle or anything up to
past the cap."""

import math
from pathlib import Path

import numpy as np
import pytest
from hypothesis import example, given
from hypothesis import strategies as st

from fairlimit.core.bucket import bucket_key
from fairlimit.core.quota import (
    Blanket,
    CapClaim,
    Holder,
    Target,
    allocate,
    code_of,
    settle,
    strategy_of,
    token_bucket,
)
from fairlimit.quota import Abandon, Assign, QuotaService, Usage
from fairlimit.quota.division import Table, changed, divide
from fairlimit.quota.targets import COMPACT_FROM
from fairlimit.store.memory import MemoryStore
from helpers import ROOT, FakeClock, load_text
from maxmin import level as exact_level

pytestmark = pytest.mark.unit
MANY = (ROOT / "descriptors" / "rlqs" / "many-clients.yaml").read_text()

CAPS = ("edge/a#1", "edge/b#1", "edge/c#1")


@st.composite
def holders(draw: st.DrawFn) -> list[Holder]:
    capacity = {c: draw(st.sampled_from([0.0, 5.0, 40.0, 100.0, 1000.0])) for c in CAPS}
    limit = {c: draw(st.sampled_from([math.inf, 10.0, 50.0])) for c in CAPS}
    clients = draw(st.integers(1, 8))
    weight = {(c, i): draw(st.sampled_from([1.0, 2.0, 0.5])) for c in CAPS for i in range(clients)}
    out: list[Holder] = []
    for b in range(draw(st.integers(1, 14))):
        kind = draw(st.sampled_from(["one", "one", "two", "own", "allow", "deny"]))
        client = draw(st.integers(0, clients - 1))
        caps = {"one": CAPS[b % 3 : b % 3 + 1], "two": CAPS[:2]}.get(kind, ())
        claims = tuple(CapClaim(c, f"u{client}", capacity[c], limit[c], weight[(c, client)])
                       for c in caps)  # fmt: skip
        own = draw(st.sampled_from([math.inf, 20.0, 300.0]))
        if kind == "own":
            own = draw(st.sampled_from([0.0, 0.05, 20.0]))
        target = (Target(Blanket.ALLOW_ALL if kind == "allow" else Blanket.DENY_ALL)
                  if kind in ("allow", "deny") else Target(None, own, claims))  # fmt: skip
        key = bucket_key({"bucket": str(b)})
        for stream in range(1, draw(st.integers(1, 3)) + 1):
            demand = draw(st.one_of(st.none(), st.just(0.0), st.floats(0.01, 2000.0)))
            interval = draw(st.sampled_from([0.5, 1.0, 5.0]))
            out.append(Holder(stream, key, target, demand, interval))
    return out


# A client's two idle buckets (own limit 80/s) alone under a 100/s cap: the slack is its, and
# halved between them (random holders seldom leave a client's part below its buckets' bounds).
SPLIT_SLACK = [
    Holder(1, bucket_key({"bucket": b}), Target(None, 80.0, (CapClaim(CAPS[0], "u0", 100.0,
                                                                      math.inf, 1.0),)),
           0.0, 5.0)
    for b in ("x", "y")
]  # fmt: skip


def divided(hs: list[Holder]) -> tuple[Table, object]:
    table = Table()
    rows = np.array([table.row(h.bucket, h.target) for h in hs], dtype=np.intp)
    demand = np.array([h.demand for h in hs], dtype=np.float64)
    interval = np.array([h.interval for h in hs], dtype=np.float64)
    return table, divide(table, rows, demand, interval)


class TestDivisionInArrays:
    @given(holders())
    @example(SPLIT_SLACK)
    def test_the_same_strategies_levels_and_headroom_as_the_reference(
        self, hs: list[Holder]
    ) -> None:
        want = allocate(hs)
        _, got = divided(hs)
        codes = got.codes.tolist()  # type: ignore[attr-defined]
        extra = got.extra.tolist()  # type: ignore[attr-defined]
        for h, code, part in zip(hs, codes, extra, strict=True):
            assert strategy_of(code) == want.strategies[(h.stream, h.bucket)], h
            if (h.stream, h.bucket) in want.extra:
                assert part == pytest.approx(want.extra[(h.stream, h.bucket)], rel=1e-9)
            else:
                assert math.isnan(part)
        assert set(got.levels) == set(want.levels)  # type: ignore[attr-defined]
        for cap, lam in want.levels.items():
            assert got.levels[cap] == pytest.approx(lam, rel=1e-9)  # type: ignore[attr-defined]
            assert got.headroom[cap] == pytest.approx(  # type: ignore[attr-defined]
                want.headroom[cap], rel=1e-9, abs=1e-9
            )

    @given(holders())
    def test_a_caps_level_is_the_exact_max_min_level(self, hs: list[Holder]) -> None:
        """At a cap whose buckets each have one client under it alone (the common case), λ
        is the exact solver's over the clients' wants (demand, or own limit unmeasured)."""
        _, got = divided(hs)
        for cap in got.levels:  # type: ignore[attr-defined]
            under = [h for h in hs if h.target.blanket is None
                     and any(c.cap == cap for c in h.target.caps)]  # fmt: skip
            wants: dict[str, float] = {}
            weight: dict[str, float] = {}
            per_bucket: dict[object, list[Holder]] = {}
            for h in under:
                per_bucket.setdefault(h.bucket, []).append(h)
            for bucket_holders in per_bucket.values():
                first = bucket_holders[0].target
                claim = next(c for c in first.caps if c.cap == cap)
                if any(h.demand is None for h in bucket_holders):
                    asked = first.limit
                else:
                    asked = min(sum(h.demand or 0.0 for h in bucket_holders), first.limit)
                wants[claim.client] = wants.get(claim.client, 0.0) + asked
                weight.setdefault(claim.client, claim.weight)
                limit, capacity = claim.client_limit, claim.capacity
            names = list(wants)
            # an endless want (unmeasured, no limit of its own) as one far past any level
            capped = [min(wants[n], limit, 1e18) for n in names]
            lam = exact_level(capped, [weight[n] for n in names], capacity)
            level = got.levels[cap]  # type: ignore[attr-defined]
            if lam == math.inf and level != math.inf:
                # every want fits: any level that meets them all is the same division (a
                # level of 49.999999999999986 met two wants of 50 filling a cap of 100)
                for want, n in zip(capped, names, strict=True):
                    assert min(want, level * weight[n]) == pytest.approx(want, rel=1e-9)
                continue
            assert level == pytest.approx(lam, rel=1e-9)

    @given(st.floats(0.1, 5000.0), st.floats(0.1, 5000.0), st.integers(2, 40), st.integers(2, 40))
    def test_changed_is_settle(self, old: float, new: float, d1: int, d2: int) -> None:
        """A new token bucket replaces the one in force exactly when ``settle`` says so."""
        current, fresh = token_bucket(old, d1), token_bucket(new, d2)
        kept = settle(current, fresh)
        moved = changed(np.array([code_of(current)], dtype=np.uint64),
                        np.array([code_of(fresh)], dtype=np.uint64))  # fmt: skip
        assert bool(moved[0]) == (kept is not current and kept != current)

    def test_codes_round_trip(self) -> None:
        for strategy in (Blanket.ALLOW_ALL, Blanket.DENY_ALL, token_bucket(12.3, 7),
                         token_bucket(1e12, 2**40)):  # fmt: skip
            assert strategy_of(code_of(strategy)) == strategy


class TestTableCompaction:
    async def test_a_report_abandoning_most_buckets_compacts_the_table_and_divides(
        self, tmp_path: Path
    ) -> None:
        """An Envoy holds 1,100 buckets; 1,000 go idle, and the periodic report that lists
        them all abandons them: the table, now mostly rows of buckets gone, is made again in
        that report's division. The buckets it abandoned are not renewed (their rows were
        of the old table: the division indexed the new one with them), and the 100 left
        are assigned as a division from scratch would."""
        loaded = load_text(tmp_path, MANY)
        clock = FakeClock()
        service = QuotaService(lambda: loaded, MemoryStore(), clock.now, abandon_after=10.0,
                               max_buckets_per_stream=2000, max_buckets=2000)  # fmt: skip
        sent: list[Assign | Abandon] = []
        stream = service.open(sent.extend)
        clients = [{"route": "public", "client_id": f"c{i}"} for i in range(COMPACT_FROM + 76)]
        await service.report(stream, "edge", [Usage(c, 0, 5) for c in clients])
        clock.advance(11.0)
        sent.clear()
        await service.report(stream, "edge", [Usage(c, 0, 5 if i < 100 else 0)
                                              for i, c in enumerate(clients)])  # fmt: skip
        assert sum(isinstance(a, Abandon) for a in sent) == len(clients) - 100
        assert len(service.targets.table) == 100
        assigned = {a.bucket["client_id"] for a in sent if isinstance(a, Assign)}
        assert assigned == {f"c{i}" for i in range(100)}
        holders = [Holder(stream.ident, key, b.target, b.demand, stream.interval)
                   for key, b in stream.buckets.items()]  # fmt: skip
        assert service.allocation.strategies == allocate(holders).strategies
