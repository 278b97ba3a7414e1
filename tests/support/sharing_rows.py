"""A client's row at a cap (core/sharing.py) made as a store makes it, request by request:
for tests that work the sharing formulas out on rows (tests/core/test_sharing_formulas.py,
and the admit script's mirror of them in tests/store). By default the cap's window is
``W`` seconds and its period ``P``."""

import math

from fairlimit.core.sharing import Clock, Row, charge, fold, record

W, P = 10, 1.0


def at(now: float, window: int = W, period: float = P) -> Clock:
    return Clock(window, period, now)


def ask(
    row: Row,
    now: float,
    hits: int,
    admitted: bool = True,
    closing: float = math.inf,
    window: int = W,
    period: float = P,
) -> Row:
    """What a store does with a request of ``hits`` at ``now`` (demand seen): fold the row,
    count the demand and, when admitted, the hits."""
    fold(row, at(now, window, period), closing)
    record(row, hits, now)
    if admitted:
        charge(row, hits)
    return row


def row_of(
    *requests: tuple[float, int],
    limit: float = math.inf,
    weight: float = 1.0,
    window: int = W,
    period: float = P,
) -> Row:
    """A new client's row after ``(time, hits)`` requests, each admitted."""
    row = Row(limit, weight)
    for now, hits in requests:
        ask(row, now, hits, window=window, period=period)
    return row
