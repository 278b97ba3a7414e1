"""The RLQS state as plain data, for /rlconfig: every stream's buckets, what each was
assigned and reported, the bucket caps, and each cap's water level and headroom."""

import math
from typing import Any

from fairlimit.core.quota import Blanket, Strategy
from fairlimit.quota import QuotaService, QuotaStream


def rlqs_report(quota: QuotaService) -> dict[str, Any]:
    """The quota service's streams, bucket caps and caps, as JSON-ready data."""
    allocation = quota.allocation
    return {
        "streams": [_stream(s) for s in quota.streams.values()],
        "buckets": {
            "held": quota.room.held,
            "max_per_stream": quota.room.per_stream,
            "max": quota.room.total,
        },
        "caps": {
            cap: {
                "fair_share_level_per_second": None if math.isinf(level) else level,
                "headroom_per_second": allocation.headroom.get(cap, 0.0),
            }
            for cap, level in sorted(allocation.levels.items())
        },
    }


def _stream(stream: QuotaStream) -> dict[str, Any]:
    return {
        "stream": stream.ident,
        "domain": stream.domain,
        "reporting_interval_seconds": stream.interval,
        "assignment_ttl_seconds": stream.ttl,
        "buckets_refused_in_last_report": stream.refused,
        "buckets": [
            {
                "bucket": dict(held.bucket),
                "descriptor": None
                if held.entries is None
                else "/".join(f"{k}={v}" for k, v in held.entries),
                "demand_per_second": held.demand,
                "assignment": _strategy(held.strategy),
                "requests_allowed": held.allowed,
                "requests_denied": held.denied,
            }
            for held in stream.buckets.values()
        ],
    }


def _strategy(strategy: Strategy | None) -> dict[str, Any] | None:
    if strategy is None:
        return None
    if isinstance(strategy, Blanket):
        return {"blanket_rule": strategy.name}
    return {
        "token_bucket": {
            "rate_per_second": strategy.rate,
            "max_tokens": strategy.max_tokens,
            "tokens_per_fill": strategy.tokens_per_fill,
            "fill_interval_seconds": strategy.fill_seconds,
        }
    }
