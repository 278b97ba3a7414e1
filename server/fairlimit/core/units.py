"""Time units and epoch-aligned fixed windows, as envoyproxy/ratelimit counts them."""

import enum
import math


class Unit(enum.Enum):
    """A rate-limit unit; the value is the window length in seconds."""

    SECOND = 1
    MINUTE = 60
    HOUR = 3600
    DAY = 86400
    WEEK = 7 * 86400
    MONTH = 30 * 86400
    YEAR = 365 * 86400

    @property
    def seconds(self) -> int:
        return self.value

    @classmethod
    def parse(cls, text: str) -> "Unit":
        """The unit named ``text`` (case-insensitive); KeyError when there is none."""
        return cls[text.strip().upper()]


def window_start(window: int, now: float) -> int:
    """Start (Unix seconds) of the window of length ``window`` that holds ``now``."""
    return math.floor(now / window) * window


def seconds_until_reset(window: int, now: float) -> int:
    """Whole seconds from ``now`` until its window of length ``window`` ends, rounded up.

    As envoyproxy/ratelimit reports it (``window - now % window`` in whole seconds): 1 to
    ``window``, never 0, so that a per-second limit never tells a client to retry at once,
    into the window that just refused it.
    """
    return window - math.floor(now) % window
