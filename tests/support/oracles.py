"""Oracles built on the server's own pieces that only the tests use.

Each is a thin composition of what the server runs (``core.fairshare.water_level``,
``core.keys``): the tests state what a result must be through them, and no server code
calls them. The independent yardstick of fairness is ``maxmin.py``.
"""

from collections.abc import Sequence

from fairlimit.core.fairshare import PeriodDemand, water_level
from fairlimit.core.keys import counter_key, escape, key_paths
from fairlimit.core.matching import Entry


def grants(
    demands: Sequence[float],
    limits: Sequence[float],
    weights: Sequence[float],
    capacity: float,
) -> list[float]:
    """What each client receives under the water level: min(d_i, L_i, λ·w_i)."""
    level = water_level(demands, limits, weights, capacity)
    return [min(d, lim, level * w) for d, lim, w in zip(demands, limits, weights, strict=True)]


def level_of(period: PeriodDemand) -> float:
    """λ of a finished period in the cap's window: the level that shares its demand."""
    demands = [d * period.scale for d in period.demands]
    return water_level(demands, period.limits, period.weights, period.capacity)


def descriptor_key(domain: str, entries: Sequence[Entry], window: int) -> str:
    """The store key of the counter for all of ``entries`` in a window of ``window`` seconds."""
    paths = key_paths(domain, entries)
    return counter_key(paths[-1] if paths else escape(domain), window)
