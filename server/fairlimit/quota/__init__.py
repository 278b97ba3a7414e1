"""The RLQS use case, beside the limiter: what Envoys report, what they are assigned.

- ``service``: the streams, each bucket's demand and assignment, TTLs and abandons, and the
  division of every cap among every stream's buckets (the math is ``core/quota.py``).
- ``usage``: the usage Envoys report, paid into the store's counters (shared with RLS) as a
  drip over the interval after each report.
"""

from fairlimit.quota.service import (
    Abandon,
    Action,
    Assign,
    QuotaService,
    QuotaStream,
    Send,
    Usage,
    target_of,
)
from fairlimit.quota.usage import UsageLedger, recorded

__all__ = ["Abandon", "Action", "Assign", "QuotaService", "QuotaStream", "Send", "Usage",
           "UsageLedger", "recorded", "target_of"]  # fmt: skip
