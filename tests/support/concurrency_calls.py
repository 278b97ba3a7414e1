"""Concurrency caps as tests call them: a config with caps at two levels, and the request-path
(acquire) and stream-done (release) calls (tests/limiter/, tests/store/)."""

from fairlimit.core.admission import Code
from fairlimit.limiter import Limiter
from helpers import desc, req

CAPPED = """
domain: edge
descriptors:
  - key: route
    value: public
    concurrency: {max_in_flight: 6, max_duration: 30}
    fair_share: {active_clients: 2, weights: {heavy: 2}}
    descriptors:
      - key: client_id
        concurrency: {max_in_flight: 4, max_duration: 30}
  - key: route
    value: api
    concurrency: {max_in_flight: 3}
    fair_share: {active_clients: 3}
    descriptors:
      - key: client_id
        rate_limit: {unit: minute, requests_per_unit: 1}
  - key: client_id
    rate_limit: {unit: minute, requests_per_unit: 3}
    concurrency: {max_in_flight: 2, max_duration: 10}
"""


async def take(limiter: Limiter, client: str, rid: str, route: str = "public") -> bool:
    """One request-path call (acquire); True when admitted."""
    entries = (f"route={route}", f"client_id={client}", f"request_id={rid}")
    return (await limiter.should_rate_limit(req("edge", desc(*entries)))).code is Code.OK


async def done(limiter: Limiter, client: str, rid: str, route: str = "public") -> None:
    """One stream-done call (release); Envoy ignores its answer, and so do we."""
    entries = (f"route={route}", f"client_id={client}", f"request_done={rid}")
    decision = await limiter.should_rate_limit(req("edge", desc(*entries)))
    assert decision.code is Code.OK


async def take_alone(limiter: Limiter, client: str, rid: str) -> bool:
    """A request under the value-less client rule only (rate 3/min, 2 in flight)."""
    decision = await limiter.should_rate_limit(
        req("edge", desc(f"client_id={client}", f"request_id={rid}"))
    )
    return decision.code is Code.OK
