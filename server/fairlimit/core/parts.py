"""One process's part of every limit, while the processes sharing a store cannot reach it.

Under ``--failure-mode local`` each of ``n`` processes (replicas x workers) that lose the
shared store goes on deciding alone, on a store of its own. Process ``k`` of ``n`` (its
place among the processes it last saw, ``0 <= k < n``) may admit ``part(limit, n, k)`` of
a window's ``limit``: ``limit // n``, and one more for the first ``limit % n`` places, so
the parts of the ``n`` places add up to the limit exactly. A limit under ``n`` gives one
hit to ``limit`` of the processes and none to the others: the sum never passes the limit.

The local store decides a ``scaled`` plan: every hit weighs ``n`` and every level admits
``n x part``. Its counters and caps so stay in the units of the whole deployment (a counter
seeded with the count last seen in the shared store, ``g``, admits ``(n x part - g) / n``
more here), its statuses report the configured limit with what would be left if every
process had done as this one, and a cap divides its capacity among its clients as it
would with everyone's demand in it. Concurrency caps are not counts of hits: their pools
hold ``part(max_in_flight, n, k)`` slots here (``scaled_claims``).
"""

import dataclasses
import math
from collections.abc import Sequence

from fairlimit.core.concurrency import Claim, Pool
from fairlimit.core.plan import Counter, Plan


def part(limit: int, processes: int, index: int) -> int:
    """Process ``index``'s part of ``limit`` among ``processes``; the parts of the indices
    ``0 .. processes - 1`` add up to ``limit``. An index past them (a process that does not
    know its place) gets ``limit // processes``."""
    whole, rest = divmod(limit, processes)
    return whole + (1 if 0 <= index < rest else 0)


def scaled(plan: Plan, processes: int, index: int) -> Plan:
    """``plan`` as process ``index`` of ``processes`` decides it alone: each level's hits
    times ``processes``, each level's limit ``processes x part``. The plan itself when there
    is one process."""
    n = processes
    if n == 1:
        return plan
    counters = tuple(
        [
            Counter(
                c.key,
                n * part(c.limit, n, index),
                c.window,
                c.hits * n,
                c.shadow,
                c.force,
                c.shape,
            )
            for c in plan.counters
        ]
    )
    shares = tuple(
        [
            dataclasses.replace(s, capacity=n * part(s.capacity, n, index), hits=s.hits * n)
            for s in plan.shares
        ]
    )
    return Plan(plan.descriptors, counters, shares)


def _pool(pool: Pool, n: int, index: int) -> Pool:
    limit = pool.client_limit
    client_limit = limit if math.isinf(limit) else float(part(int(limit), n, index))
    return dataclasses.replace(pool, limit=part(pool.limit, n, index), client_limit=client_limit)


def scaled_claims(claims: Sequence[Claim], processes: int, index: int) -> tuple[Claim, ...]:
    """``claims`` with every pool holding process ``index``'s part of its slots (and, at a
    cap, of the client's own ``max_in_flight``)."""
    if processes == 1:
        return tuple(claims)
    return tuple(
        [
            Claim(c.request_id, tuple([_pool(p, processes, index) for p in c.pools]), c.descriptor)
            for c in claims
        ]
    )
