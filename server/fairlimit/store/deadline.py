"""The caller's deadline for the store calls of one request, and the timeout it leaves.

Envoy sends ``grpc-timeout`` with every call; work done after it has passed is work nobody
waits for. The limiter sets the deadline (a ``time.monotonic()`` instant) in a context
variable for the duration of one ``admit``: each gRPC call runs in its own task, so calls
never see each other's. A store that makes network calls bounds each by ``timeout``.
"""

import time
from contextvars import ContextVar

from fairlimit.errors import DeadlineExceeded

DEADLINE: ContextVar[float | None] = ContextVar("fairlimit_store_deadline", default=None)
FLOOR = 0.001  # less than this left: no backend call can come back in time
CEILING = 0.25  # a generous deadline (seconds) still bounds a backend call by this
RESERVE = 0.0005  # kept for answering once the backend has


def timeout(default: float) -> float:
    """Seconds one backend call may take now: ``default`` when the caller set no deadline,
    else what the deadline leaves (less RESERVE), at most CEILING; DeadlineExceeded when
    that is under FLOOR."""
    deadline = DEADLINE.get()
    if deadline is None:
        return default
    left = deadline - time.monotonic() - RESERVE
    if left < FLOOR:
        raise DeadlineExceeded(f"the caller's deadline leaves {max(left, 0) * 1000:.1f} ms")
    return min(left, CEILING)
