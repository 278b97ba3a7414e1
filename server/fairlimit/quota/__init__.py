"""The RLQS use case, beside the limiter: what Envoys report, what they are assigned.

- ``stream``: one Envoy's stream as kept here (its interval, its buckets' demand and
  strategy in force), and the report lines and actions it trades.
- ``columns``: those lines and actions in columns, as the RLQS servicer hands and takes them.
- ``service``: every stream, TTLs and abandons, and the division of every cap among every
  stream's buckets (the math is ``core/quota.py``).
- ``remote``: what a division counts besides this process's streams: the other processes'
  buckets (``peers``: their reports, traded through the store) and the RLS demand at caps.
- ``usage``: the usage Envoys report, paid into the store's counters (shared with RLS) as a
  drip over the interval after each report.
"""

from fairlimit.quota.columns import Assigns, Lines
from fairlimit.quota.service import QuotaService
from fairlimit.quota.stream import Abandon, Action, Assign, QuotaStream, Send, Usage
from fairlimit.quota.usage import UsageLedger, recorded

__all__ = ["Abandon", "Action", "Assign", "Assigns", "Lines", "QuotaService", "QuotaStream",
           "Send", "Usage", "UsageLedger", "recorded"]  # fmt: skip
