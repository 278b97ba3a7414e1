"""RLQS across processes: every quota service's demand, shared through the store.

Each fairlimit process (each ``--workers`` worker, each replica) holds the RLQS streams of
the Envoys connected to it. Alone, it would divide every cap among those streams only, and N
processes would let a cap through N times. So every ``EXCHANGE_SECONDS`` each process hands
the store its *report* (per bucket it holds: the domain, the bucket id, the demand its
streams measured, how many of its streams hold it and their reporting interval) and receives
every other live process's (``Store.exchange_demand``; Redis keeps them in one hash, memory
in the store object, for processes that share it in tests and simulations).

The other processes' buckets then join the division as *remote holders*: they take part in
the water-filling at every cap and in the split of a bucket's bound among the streams that
hold it, but are assigned nothing here (their own process assigns them, from the same
reports). Every process so divides every cap among every Envoy's demand, and assigns its own
Envoys their part. A report lives ``PEER_TTL``: a process that stops reporting (stopped,
crashed, cut off from the store) leaves the others' division after that.

RLS traffic at the same caps takes part too: each process tallies the hits its RLS
requests ask at fair-share caps (``core/tally.py``, admitted or not), per descriptor as a
bucket id, and its report carries them as rates. Every process adds its own and the others'
as holders that are assigned nothing, so an RLS client's demand lowers the RLQS shares at
its cap as an Envoy's would (and RLS requests see RLQS usage in the shared counters, paid in
by ``usage.py``). What a report does not carry: a bucket's first moments on another process
(its report comes up to ``EXCHANGE_SECONDS`` later).
"""

import json
import math
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass

from fairlimit.core.bucket import BucketKey

EXCHANGE_SECONDS = 1.0  # how often a process hands in its report and reads the others'
PEER_TTL = 3 * EXCHANGE_SECONDS  # how long a report counts without being renewed


@dataclass(frozen=True, slots=True)
class PeerBucket:
    """One bucket as one process holds it."""

    domain: str
    bucket: BucketKey
    demand: float | None  # requests/s over its streams; None while any is unmeasured
    holders: int  # its streams holding the bucket
    interval: float  # their longest reporting interval, seconds


@dataclass(frozen=True, slots=True)
class Report:
    """One process's report: the RLQS buckets its streams hold, and the RLS demand at
    fair-share caps it saw (as buckets of one holder each, over the last exchange)."""

    buckets: list[PeerBucket]
    rls: list[PeerBucket]


def encode(report: Report) -> str:
    """A report as text: a JSON object whose ``buckets`` and ``rls`` are lists of [domain,
    [[key, value], ...], demand, holders, interval]."""
    return assemble([encode_rows(report.buckets)], report.rls)


def encode_rows(buckets: Sequence[PeerBucket]) -> str:
    """Some of a report's buckets, encoded (``assemble`` puts the parts together, so that
    a report of thousands of buckets is encoded a part at a time)."""
    return json.dumps(_rows(buckets), separators=(",", ":"))[1:-1]


def assemble(parts: Iterable[str], rls: Sequence[PeerBucket]) -> str:
    """The text of a report whose buckets were encoded in ``parts`` (``encode_rows``)."""
    return f'{{"buckets":[{",".join(p for p in parts if p)}],"rls":[{encode_rows(rls)}]}}'


def _rows(buckets: Iterable[PeerBucket]) -> list[list[object]]:
    return [[b.domain, [list(kv) for kv in b.bucket], b.demand, b.holders, b.interval]
            for b in buckets]  # fmt: skip


def decode(text: str) -> Report:
    """A report from ``encode``; ValueError names what is wrong with one that is not."""
    raw = json.loads(text)
    if not (isinstance(raw, dict) and isinstance(raw.get("buckets"), list)
            and isinstance(raw.get("rls"), list)):  # fmt: skip
        raise ValueError("a demand report is a JSON object with lists buckets and rls")
    return Report(_decode_rows(raw["buckets"]), _decode_rows(raw["rls"]))


def _decode_rows(raw: list[object]) -> list[PeerBucket]:
    out: list[PeerBucket] = []
    for item in raw:
        if not (isinstance(item, list) and len(item) == 5):
            raise ValueError(f"a demand report entry has 5 parts, not {item!r}")
        domain, pairs, demand, holders, interval = item
        if not isinstance(pairs, list) or not all(isinstance(p, list) and len(p) == 2
                                                  for p in pairs):  # fmt: skip
            raise ValueError(f"a bucket id is a list of [key, value] pairs, not {pairs!r}")
        bucket = tuple((str(k), str(v)) for k, v in pairs)
        rate = None if demand is None else float(demand)
        if rate is not None and not (math.isfinite(rate) and rate >= 0):
            raise ValueError(f"a demand must be a finite rate >= 0, not {demand!r}")
        count, seconds = int(holders), float(interval)
        if count < 1 or not (math.isfinite(seconds) and seconds > 0):
            raise ValueError(f"holders must be >= 1 and the interval > 0, not {item!r}")
        out.append(PeerBucket(str(domain), bucket, rate, count, seconds))
    return out


@dataclass(frozen=True, slots=True)
class Held:
    """One local stream's hold on a bucket, as the report counts it."""

    domain: str
    bucket: BucketKey
    demand: float | None
    interval: float


def summarise(held: Iterable[Held]) -> list[PeerBucket]:
    """This process's report: its streams' holds summed per (domain, bucket)."""
    totals: Totals = {}
    add_held(totals, held)
    return list(totals.values())


Totals = dict[tuple[str, BucketKey], PeerBucket]


def add_held(totals: Totals, held: Iterable[Held]) -> None:
    """Sum ``held`` into ``totals`` (``summarise``, some streams at a time)."""
    for h in held:
        known = totals.get((h.domain, h.bucket))
        if known is None:
            totals[(h.domain, h.bucket)] = PeerBucket(h.domain, h.bucket, h.demand, 1, h.interval)
            continue
        demand = None if known.demand is None or h.demand is None else known.demand + h.demand
        totals[(h.domain, h.bucket)] = PeerBucket(h.domain, h.bucket, demand, known.holders + 1,
                                                  max(known.interval, h.interval))  # fmt: skip


def remote_counts(peers: Mapping[str, Report]) -> dict[BucketKey, int]:
    """How many remote streams hold each bucket."""
    out: dict[BucketKey, int] = {}
    for report in peers.values():
        for b in report.buckets:
            out[b.bucket] = out.get(b.bucket, 0) + b.holders
    return out


def rls_demand(counts: Mapping[tuple[str, BucketKey], int], seconds: float) -> list[PeerBucket]:
    """A tally of RLS hits (``core.tally.Tally.take``) over ``seconds`` as rates."""
    span = max(seconds, 1e-3)
    return [PeerBucket(domain, bucket, hits / span, 1, max(seconds, EXCHANGE_SECONDS))
            for (domain, bucket), hits in counts.items() if hits > 0]  # fmt: skip
