"""An exact weighted max-min solver, the yardstick of the fairness scenarios.

Written apart from ``fairlimit.core.fairshare`` on purpose: the server's water-filling is
what is being measured, so it cannot also be the reference. Three views of one idea:

- ``maxmin``: one cap over one window. Client i wants ``min(d_i, L_i)``; the level λ solves
  ``sum_i min(d_i, L_i, λ·w_i) = C`` (λ = inf when every want fits) and client i gets
  ``x_i = min(d_i, L_i, λ·w_i)``. Exact water-filling in rationals when the inputs are
  rationals (``fractions.Fraction``), so hand-computed cases compare with ``==``.
- ``allocate``: nested caps (route > tenants > users), bottom-up. A child's effective demand
  is what its own limit and its children can admit; each cap then shares what it received
  top-down among its children by those effective demands.
- ``unfolding_bound``: the share of a window that is fair *as it unfolds*. At elapsed time s
  the fair amount of client i is its max-min share of the capacity elapsed by ``s + slack``
  (``C·min(1, (s + slack) / W)``) over the demand seen by s. Work conservation lets a client
  alone early take what no one else asked for, so the bound is the running maximum over
  s' <= s of that share: a client may keep what was once fair, never more.
"""

import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from fractions import Fraction

Number = float | Fraction | int
INF = math.inf


def level(wants: Sequence[Number], weights: Sequence[Number], capacity: Number) -> Number:
    """λ with ``sum_i min(want_i, λ·w_i) = capacity``; inf when ``sum(wants) <= capacity``.

    Clients are raised together in order of ``want_i / w_i``: each one that is met leaves the
    pool with its want, the rest share what is left by weight. Weights must be positive.
    """
    if any(w <= 0 for w in weights):
        raise ValueError("weights must be positive")
    if sum(wants) <= capacity:
        return INF
    exact = all(isinstance(x, int | Fraction) for x in (*wants, *weights, capacity))
    order = sorted(range(len(wants)), key=lambda i: Fraction(wants[i]) / weights[i])
    left: Number = Fraction(capacity) if exact else capacity
    weight_left: Number = sum(weights)
    for i in order:
        water = left / weight_left
        if wants[i] > water * weights[i]:
            return water
        left -= wants[i]
        weight_left -= weights[i]
    raise AssertionError("unreachable: the wants exceed the capacity")


def maxmin(
    demands: Sequence[Number],
    limits: Sequence[Number],
    weights: Sequence[Number],
    capacity: Number,
) -> list[Number]:
    """Each client's weighted max-min allocation ``min(d_i, L_i, λ·w_i)``."""
    wants = [min(d, lim) for d, lim in zip(demands, limits, strict=True)]
    lam = level(wants, weights, capacity)
    if lam == INF:
        return list(wants)
    return [min(want, lam * w) for want, w in zip(wants, weights, strict=True)]


def jain(values: Sequence[float]) -> float:
    """Jain's index: 1 when all are equal, 1/n when one holds everything (1 when empty)."""
    square = sum(v * v for v in values)
    return 1.0 if not values or square == 0 else sum(values) ** 2 / (len(values) * square)


# --- nested caps ---------------------------------------------------------------------------


@dataclass(frozen=True)
class Node:
    """A client (no children: ``demand``) or a cap over children (``limit`` is its cap).

    ``limit`` is the most the node may receive from its parent in the window (its own rate
    limit; at the root, the root cap), ``weight`` its weight at the parent.
    """

    name: str
    limit: Number = INF
    weight: Number = 1
    demand: Number = 0
    children: tuple["Node", ...] = ()


def effective_demand(node: Node) -> Number:
    """What the node can admit: its demand, bounded by its limit and by its children's."""
    if not node.children:
        return min(node.demand, node.limit)
    return min(node.limit, sum(effective_demand(c) for c in node.children))


@dataclass
class Allocation:
    """What every node received, by path (``route/tenant/user``)."""

    given: dict[str, Number] = field(default_factory=dict)

    def __getitem__(self, path: str) -> Number:
        return self.given[path]


def allocate(root: Node, parent: str = "") -> Allocation:
    """Share ``root.limit`` down the tree by weighted max-min over effective demands."""
    out = Allocation()
    path = f"{parent}/{root.name}" if parent else root.name
    _share(root, path, min(root.limit, effective_demand(root)), out)
    return out


def _share(node: Node, path: str, amount: Number, out: Allocation) -> None:
    out.given[path] = amount
    if not node.children:
        return
    wants = [effective_demand(c) for c in node.children]
    inf_limits = [INF] * len(wants)
    parts = maxmin(wants, inf_limits, [c.weight for c in node.children], amount)
    for child, part in zip(node.children, parts, strict=True):
        _share(child, f"{path}/{child.name}", part, out)


# --- a window as it unfolds ----------------------------------------------------------------


def unfolding_bound(
    capacity: Number,
    window: float,
    slack: float,
    samples: Sequence[tuple[float, Sequence[Number]]],
    limits: Sequence[Number],
    weights: Sequence[Number],
) -> list[list[Number]]:
    """Per sample (elapsed seconds s, cumulative demand per client by s, in time order):
    the most each client may have been admitted by s (see the module docstring)."""
    best: list[Number] = [0 for _ in limits]
    out: list[list[Number]] = []
    for elapsed, demand in samples:
        part: Number = min(Fraction(1), (Fraction(elapsed) + Fraction(slack)) / Fraction(window))
        open_part = capacity * (part if isinstance(capacity, int | Fraction) else float(part))
        fair = maxmin(demand, limits, weights, open_part)
        best = [max(b, f) for b, f in zip(best, fair, strict=True)]
        out.append(list(best))
    return out


def per_window(
    demands: Mapping[str, Number],
    limits: Mapping[str, Number],
    weights: Mapping[str, Number],
    capacity: Number,
) -> dict[str, Number]:
    """``maxmin`` keyed by client name (clients in the demand mapping's order)."""
    names = list(demands)
    got = maxmin(
        [demands[c] for c in names],
        [limits.get(c, INF) for c in names],
        [weights.get(c, 1) for c in names],
        capacity,
    )
    return dict(zip(names, got, strict=True))
