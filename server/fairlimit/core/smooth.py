"""The smooth algorithms: a sliding window and GCRA, as counts the admission rule reads.

Both are reduced to a count beside the counter's ``limit``, so ``core/admission.py`` decides
them as it decides a fixed window (``count + hits > limit`` refuses):

* ``sliding``: the window is cut into ``SLIDING_PARTS`` sub-windows; the count is the hits
  of the sub-window holding ``now`` and of the ``SLIDING_PARTS`` before it. That covers the
  last window and a little more (the whole oldest sub-window), so it never counts less than
  an exact log would: no span of one window, wherever it starts, admits more than the
  limit. The price: up to one sub-window (a twentieth of the window) of hits counted longer.
* ``gcra``: the generic cell rate algorithm (a token bucket): a theoretical arrival time
  ``tat`` moves on by ``window / limit`` per hit; ``burst + 1`` hits fit at once, refilled
  at ``limit`` per window, so any span of one window admits at most ``limit + burst``.

store/counters.py keeps the state and store/redis/lua/admit/meters.lua does the same
arithmetic in the same order, so both backends reach the same doubles.
"""

import math

from fairlimit.core.plan import Counter
from fairlimit.core.units import SLIDING_PARTS

EPSILON = 1e-9  # a count of used hits this close under a whole one is that whole one


def interval(counter: Counter) -> float:
    """GCRA's emission interval: seconds one hit takes to come back."""
    return counter.window / counter.limit


def capacity(counter: Counter) -> int:
    """How many hits GCRA admits at once from a full bucket."""
    assert counter.shape is not None
    return counter.shape.burst + 1


def gcra_count(counter: Counter, tat: float, now: float) -> int:
    """The count that refuses exactly what the bucket at ``tat`` refuses at ``now``."""
    if counter.limit == 0:
        return 0
    used = max(0.0, tat - now) / interval(counter)
    return counter.limit - capacity(counter) + math.ceil(used - EPSILON)


def gcra_charged(counter: Counter, tat: float, now: float, hits: int) -> float:
    """``tat`` after ``hits`` more hits at ``now``."""
    if counter.limit == 0 or hits == 0:
        return tat
    return max(tat, now) + hits * interval(counter)


def part(counter: Counter, now: float) -> int:
    """The index of the sub-window that holds ``now``."""
    return math.floor(now * SLIDING_PARTS / counter.window)


def sliding_full_at(counter: Counter, newest: int) -> float:
    """When the hits of sub-window ``newest`` have left the count."""
    return (newest + SLIDING_PARTS + 1) * counter.window / SLIDING_PARTS
