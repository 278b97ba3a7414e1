"""Weighted max-min fairness at a cap: the water level λ and the fairness figures.

The level λ solves ``sum_i min(d_i, L_i, λ·w_i) = C``; it is infinite when every capped
demand fits under the cap. Water-filling sorts clients by ``min(d_i, L_i) / w_i`` and raises
one level: O(n log n), run once per period per cap, never per request.

Every store and the telemetry of global buckets turn a finished period into its figures
the same way: ``PeriodDemand`` -> ``figures_of``. A store reports each cap instance as a
``CapReport``.
"""

import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass

INFINITE = math.inf


def water_level(
    demands: Sequence[float],
    limits: Sequence[float],
    weights: Sequence[float],
    capacity: float,
) -> float:
    """The level λ that shares ``capacity`` by weighted max-min fairness."""
    wants = [d if d <= lim else lim for d, lim in zip(demands, limits, strict=True)]
    if sum(wants) <= capacity:
        return INFINITE
    ratios = [w / wt for w, wt in zip(wants, weights, strict=True)]
    order = sorted(range(len(wants)), key=ratios.__getitem__)  # a C key: no lambda per client
    left = float(capacity)
    weight_left = float(sum(weights))
    for i in order:
        level = left / weight_left
        want, weight = wants[i], weights[i]
        if want <= level * weight:
            left -= want
            weight_left -= weight
        else:
            return level
    return INFINITE  # unreachable when sum(wants) > capacity; kept total for safety


def jain_index(shares: Sequence[float]) -> float:
    """Jain's fairness index of ``shares``: 1 when all are equal, 1/n at worst."""
    if not shares:
        return 1.0
    square_sum = sum(x * x for x in shares)
    if square_sum == 0:
        return 1.0
    return sum(shares) ** 2 / (len(shares) * square_sum)


@dataclass(frozen=True, slots=True)
class FairnessFigures:
    """How fairly one cap was shared over one period."""

    utilization: float  # admitted / capacity
    active_clients: int  # clients with demand in the period
    level: float  # λ of the period's own demand (inf when it fitted)
    jain_index: float  # over x_i = admitted_i / min(d_i, L_i, λ·w_i)
    top_client_share: float  # largest client's part of what was admitted
    starved_clients: int  # clients with x_i < 0.9


STARVED_BELOW = 0.9


def fairness_figures(
    demands: Sequence[float],
    admitted: Sequence[float],
    limits: Sequence[float],
    weights: Sequence[float],
    capacity: float,
) -> FairnessFigures:
    """The fairness figures of one period, measured against its own max-min ideal."""
    level = water_level(demands, limits, weights, capacity)
    ratios: list[float] = []
    for d, a, lim, w in zip(demands, admitted, limits, weights, strict=True):
        fair = min(d, lim, level * w)
        if fair > 0:
            ratios.append(a / fair)
    total = float(sum(admitted))
    return FairnessFigures(
        utilization=total / capacity if capacity > 0 else 0.0,
        active_clients=sum(1 for d in demands if d > 0),
        level=level,
        jain_index=jain_index(ratios),
        top_client_share=max(admitted) / total if total > 0 else 0.0,
        starved_clients=sum(1 for x in ratios if x < STARVED_BELOW),
    )


@dataclass(frozen=True, slots=True)
class PeriodDemand:
    """One finished period at a cap: what each client asked for and was admitted.

    ``demands`` and ``admitted`` are hits in the period; ``capacity`` and ``limits`` are in
    the cap's window, which is ``scale`` periods long (window / period). The sequences are
    not copied (a period can hold 100k clients, and the request that ends it waits for λ):
    nothing changes them once built.
    """

    capacity: float
    scale: float
    demands: Sequence[float]
    admitted: Sequence[float]
    limits: Sequence[float]
    weights: Sequence[float]

    @classmethod
    def of(
        cls,
        capacity: float,
        demand: Mapping[str, float],
        admitted: Mapping[str, float],
        limits: Mapping[str, float] | None = None,
        weights: Mapping[str, float] | None = None,
        scale: float = 1.0,
    ) -> "PeriodDemand":
        """The period of the clients in ``demand``; no limits means none, no weights all 1."""
        clients = list(demand)
        n = len(clients)
        return cls(
            capacity,
            scale,
            [float(demand[c]) for c in clients],
            [float(admitted.get(c, 0)) for c in clients],
            [limits[c] for c in clients] if limits is not None else [INFINITE] * n,
            [weights[c] for c in clients] if weights is not None else [1.0] * n,
        )


def figures_of(period: PeriodDemand) -> FairnessFigures:
    """The period's fairness figures, in hits per period."""
    scale = period.scale
    return fairness_figures(
        period.demands,
        period.admitted,
        [lim / scale for lim in period.limits],
        period.weights,
        period.capacity / scale,
    )


@dataclass(frozen=True, slots=True)
class CapReport:
    """A cap instance's state for telemetry: λ in force and the last full period's figures."""

    cap: str
    level: float | None  # None: no history yet (equal split among clients seen)
    declared_clients: int
    figures: FairnessFigures | None
