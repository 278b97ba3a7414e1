"""The RLQS division in arrays: ``core.quota.allocate``'s arithmetic over every holder at once.

A division at 50,000 clients held on two Envoys took 1.3 s as a loop over Python objects
(bench/quota_division.py). Here the buckets, clients and caps that ever took part are rows
of a ``Table`` (made once per bucket, when it is first seen), and a division is a few numpy
passes over the holders' rows and demands: per bucket its demand and bound, per cap its
water level (all caps at once: clients sorted by cap, then by want over weight, as
``fairshare.water_level`` sorts them) and slack, per holder its rate, depth and token
bucket. The result is a code per holder (``code_of``): what Python then touches is only the
holders whose assignment changed, or that the reporting stream asked to renew.

``core.quota.allocate`` is the reference: the RLQS tests compare the two on every division
they make, and tests/quota/test_division.py on random holders.
"""

import math
from dataclasses import dataclass

import numpy as np
import numpy.typing as npt

from fairlimit.core.bucket import BucketKey
from fairlimit.core.quota import (
    ALLOW,
    BOUND_DEPTH_SECONDS,
    DENY,
    FILL_SECONDS,
    HEADROOM,
    HEADROOM_FLOOR,
    MAX_DEPTH_SECONDS,
    SETTLE,
    TOKEN,
    UINT32_MAX,
    Target,
)

Floats = npt.NDArray[np.float64]
Ints = npt.NDArray[np.intp]
Codes = npt.NDArray[np.uint64]


@dataclass(frozen=True, slots=True)
class Rows:
    """A ``Table`` as arrays."""

    limit: Floats  # per bucket: its own limit per second (inf: none, or a blanket rule)
    blanket: Ints  # per bucket: -1 counted, else its Blanket's value
    first_cap: Ints  # per bucket: the row of its first cap (its region), -1 none
    claim_bucket: Ints  # per claim (a bucket's claim at one cap): the bucket's row
    claim_client: Ints  # ... and the row of its client at that cap
    client_cap: Ints  # per client (of a cap): the cap's row
    client_limit: Floats  # per client: its limit per second (inf: none)
    client_weight: Floats
    capacity: Floats  # per cap, per second


class Table:
    """Rows of every bucket (with its target), cap and cap's client seen since the last
    reset (a reload, or when most rows are of buckets gone: ``QuotaService`` resets it)."""

    def __init__(self) -> None:
        self.rows: dict[BucketKey, int] = {}
        self.caps: dict[str, int] = {}
        self.cap_names: list[str] = []
        self._clients: dict[tuple[str, str], int] = {}
        self._limit: list[float] = []
        self._blanket: list[int] = []
        self._first_cap: list[int] = []
        self._claim_bucket: list[int] = []
        self._claim_client: list[int] = []
        self._client_cap: list[int] = []
        self._client_limit: list[float] = []
        self._client_weight: list[float] = []
        self._capacity: list[float] = []
        self._arrays: Rows | None = None

    def __len__(self) -> int:
        return len(self._limit)

    def row(self, key: BucketKey, target: Target) -> int:
        """The row of bucket ``key``, governed by ``target`` (the first one given since the
        last reset: every target of a bucket is the same under one config)."""
        found = self.rows.get(key)
        if found is not None:
            return found
        self._arrays = None
        row = self.rows[key] = len(self._limit)
        self._limit.append(target.limit if target.blanket is None else math.inf)
        self._blanket.append(-1 if target.blanket is None else target.blanket.value)
        first = -1
        for claim in target.caps if target.blanket is None else ():
            cap = self.caps.get(claim.cap)
            if cap is None:
                cap = self.caps[claim.cap] = len(self.cap_names)
                self.cap_names.append(claim.cap)
                self._capacity.append(claim.capacity)
            client = self._clients.get((claim.cap, claim.client))
            if client is None:
                client = self._clients[(claim.cap, claim.client)] = len(self._client_cap)
                self._client_cap.append(cap)
                self._client_limit.append(claim.client_limit)
                self._client_weight.append(claim.weight)
            self._claim_bucket.append(row)
            self._claim_client.append(client)
            first = cap if first < 0 else first
        self._first_cap.append(first)
        return row

    def arrays(self) -> Rows:
        if self._arrays is None:
            self._arrays = Rows(
                _floats(self._limit), _ints(self._blanket), _ints(self._first_cap),
                _ints(self._claim_bucket), _ints(self._claim_client), _ints(self._client_cap),
                _floats(self._client_limit), _floats(self._client_weight),
                _floats(self._capacity),
            )  # fmt: skip
        return self._arrays


def _ints(values: list[int]) -> Ints:
    return np.array(values, dtype=np.intp)


def _floats(values: list[float]) -> Floats:
    return np.array(values, dtype=np.float64)


@dataclass(frozen=True, slots=True)
class Divided:
    """A division: per holder its strategy's code and its part of the headroom (nan: none),
    per cap taking part its water level and headroom."""

    codes: Codes
    extra: Floats
    levels: dict[str, float]
    headroom: dict[str, float]


def divide(table: Table, bucket: Ints, demand: Floats, interval: Floats) -> Divided:
    """Every holder's strategy (see ``core.quota``): ``bucket`` its row, ``demand`` its
    measured demand (nan before the first measurement), ``interval`` its stream's."""
    t = table.arrays()
    nb = len(t.limit)
    measured = ~np.isnan(demand)
    d0 = np.where(measured, demand, 0.0)
    holders = np.bincount(bucket, minlength=nb)
    unmeasured = np.bincount(bucket, weights=~measured, minlength=nb) > 0
    total = np.bincount(bucket, weights=d0, minlength=nb)
    loose_h = d0 * (1 + HEADROOM) + HEADROOM_FLOOR
    loose = np.bincount(bucket, weights=loose_h, minlength=nb)
    counted = (holders > 0) & (t.blanket < 0)
    wants = np.where(unmeasured, t.limit, np.minimum(total, t.limit))
    bounds = t.limit.copy()
    taking = counted[t.claim_bucket]
    cb, cc = t.claim_bucket[taking], t.claim_client[taking]
    levels: dict[str, float] = {}
    headroom: dict[str, float] = {}
    caps_in: Ints = np.zeros(0, dtype=np.intp)
    room = np.full(nb, math.inf)  # a below-bound bucket's part of its caps' slack
    if len(cb):
        ncl = len(t.client_cap)
        keys = np.bincount(cc, minlength=ncl)
        asked = np.bincount(cc, weights=wants[cb], minlength=ncl)
        active = np.flatnonzero(keys)
        level = _water_levels(np.minimum(asked[active], t.client_limit[active]),
                              t.client_weight[active], t.client_cap[active],
                              t.capacity)  # fmt: skip
        client_bound = np.minimum(t.client_limit, level[t.client_cap] * t.client_weight)
        k, tot, cbound = keys[cc], asked[cc], client_bound[cc]
        with np.errstate(divide="ignore", invalid="ignore"):
            even = (tot <= 0) | np.isinf(tot) | np.isinf(cbound)
            part = np.where(even, 1.0 / k, wants[cb] / tot)
            claim_bound = np.where(k == 1, cbound, cbound * part)
        np.minimum.at(bounds, cb, claim_bound)
        below = counted & ~unmeasured & (loose <= bounds) & (bounds > 0) & np.isfinite(bounds)
        _share_slack(t, level, asked.astype(np.float64, copy=False), active, (cb, cc), below,
                     room)  # fmt: skip
        caps_in = np.unique(t.client_cap[active])
        levels = dict(zip([table.cap_names[c] for c in caps_in], level[caps_in].tolist(),
                          strict=True))  # fmt: skip
    # per holder
    bound = bounds[bucket]
    n = holders[bucket]
    unm = unmeasured[bucket]
    fits = loose[bucket] <= bound
    tot_h = total[bucket]
    blanket = t.blanket[bucket]
    token = (blanket < 0) & (bound > 0) & ~np.isinf(bound)
    at_rule_3 = loose[bucket]
    with np.errstate(divide="ignore", invalid="ignore"):
        more = (np.minimum(bound, np.maximum(at_rule_3, tot_h + room[bucket])) - at_rule_3) / n
        rate = np.where(unm | (~fits & (tot_h <= 0)), bound / n,
                        np.where(fits, loose_h + more, bound * d0 / tot_h))  # fmt: skip
    rate = np.where(token, rate, 1.0)
    bottlenecked = ~unm & ~fits
    seconds = np.where(bottlenecked, BOUND_DEPTH_SECONDS,
                       np.where(measured, np.minimum(interval / 2, MAX_DEPTH_SECONDS),
                                MAX_DEPTH_SECONDS))  # fmt: skip
    depth = np.clip(np.maximum(2, np.ceil(rate * seconds - 1e-9)), 1, UINT32_MAX)
    fill = np.clip(np.floor(rate * FILL_SECONDS + 1e-9), 1, UINT32_MAX)
    codes = fill.astype(np.uint64) << np.uint64(32) | depth.astype(np.uint64)
    codes = np.where(blanket >= 0, blanket.astype(np.uint64), codes)
    codes = np.where((blanket < 0) & (bound <= 0), np.uint64(DENY), codes)
    codes = np.where((blanket < 0) & np.isinf(bound), np.uint64(ALLOW), codes)
    extra = np.where(token & ~unm & (tot_h < bound), rate - d0, np.nan)  # see allocation
    if len(cb):
        per_bucket = np.bincount(bucket, weights=np.nan_to_num(extra, nan=0.0), minlength=nb)
        per_cap = np.bincount(t.client_cap[cc], weights=per_bucket[cb], minlength=len(t.capacity))
        headroom = dict(zip([table.cap_names[c] for c in caps_in], per_cap[caps_in].tolist(),
                            strict=True))  # fmt: skip
    return Divided(codes, extra, levels, headroom)


def _share_slack(
    t: Rows,
    level: Floats,
    asked: Floats,
    active: Ints,
    claims: tuple[Ints, Ints],
    below: npt.NDArray[np.bool_],
    room: Floats,
) -> None:
    """Lower ``room`` (per bucket) to each below-bound bucket's part of each of its caps'
    slack (``core.quota._rooms``): ``asked`` per client, the wants of its buckets;
    ``claims`` the (bucket, client) rows of the claims taking part."""
    cb, cc = claims
    ncap = len(t.capacity)
    grant = np.minimum(asked[active], t.client_limit[active])
    granted = np.bincount(t.client_cap[active], weights=grant, minlength=ncap)
    slack = np.where(np.isinf(level), np.maximum(0.0, t.capacity - granted), 0.0)
    opened = below[cb]
    keys = np.bincount(cc, weights=opened, minlength=len(t.client_cap))
    weight = np.bincount(t.client_cap, weights=np.where(keys > 0, t.client_weight, 0.0),
                         minlength=ncap)  # fmt: skip
    cap = t.client_cap[cc[opened]]
    with np.errstate(divide="ignore", invalid="ignore"):
        share = slack[cap] * t.client_weight[cc[opened]] / weight[cap] / keys[cc[opened]]
    np.minimum.at(room, cb[opened], share)


def _water_levels(want: Floats, weight: Floats, cap: Ints, capacity: Floats) -> Floats:
    """λ per cap (``fairshare.water_level`` for every cap at once; inf where the wants fit
    or the cap has no client): clients sorted by cap, then by want over weight."""
    level = np.full(len(capacity), math.inf)
    if not len(want):
        return level
    order = np.lexsort((want / weight, cap))
    w, wt, c = want[order], weight[order], cap[order]
    # An infinite want (an unmeasured bucket without a limit of its own) is over any level:
    # it ends its cap's filling, so the sums count it as 0 (they would turn to nan).
    endless = np.isinf(w)
    finite = np.where(endless, 0.0, w)
    starts = np.flatnonzero(np.r_[True, c[1:] != c[:-1]])
    ends = np.r_[starts[1:], len(c)]
    seg = np.repeat(np.arange(len(starts)), ends - starts)
    cw, cwt = np.r_[0.0, np.cumsum(finite)], np.r_[0.0, np.cumsum(wt)]
    before_w = cw[:-1] - cw[starts][seg]  # wants of the clients before, in the cap
    before_wt = cwt[:-1] - cwt[starts][seg]
    caps = c[starts]
    sum_wt = cwt[ends] - cwt[starts]
    cap_c = capacity[caps]
    more = (cw[ends] - cw[starts] > cap_c) | np.logical_or.reduceat(endless, starts)
    with np.errstate(divide="ignore", invalid="ignore"):
        at = (cap_c[seg] - before_w) / (sum_wt[seg] - before_wt)
    over = endless | (w > at * wt)
    first = np.minimum.reduceat(np.where(over, np.arange(len(w)), len(w)), starts)
    found = (first < len(w)) & more
    level[caps[found]] = at[first[found]]
    return level


def changed(current: Codes, new: Codes) -> npt.NDArray[np.bool_]:
    """Per holder, whether ``new`` replaces ``current`` (``core.quota.settle``: a token
    bucket within SETTLE of the rate in force keeps the one in force)."""
    both = (current >= TOKEN) & (new >= TOKEN)
    now = (current >> np.uint64(32)).astype(np.float64) / FILL_SECONDS
    then = (new >> np.uint64(32)).astype(np.float64) / FILL_SECONDS
    settled = both & (np.abs(then - now) <= SETTLE * now)
    out: npt.NDArray[np.bool_] = ~settled & (current != new)
    return out
