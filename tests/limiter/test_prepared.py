"""The servicer keeps parsed, validated and planned requests by payload: reuse never changes
an answer (a config swap re-plans, a bad payload is rejected every time)."""

from pathlib import Path

import grpc
import pytest

from fairlimit._proto.envoy.extensions.common.ratelimit.v3 import ratelimit_pb2
from fairlimit._proto.envoy.service.ratelimit.v3 import rls_pb2
from fairlimit.grpc_api import servicer as servicer_module
from fairlimit.grpc_api.servicer import RateLimitServicer
from fairlimit.limiter import Limiter
from fairlimit.store.memory import MemoryStore
from fairlimit.telemetry import Telemetry
from helpers import Aborted, CallContext, FakeClock, asked, load_text

pytestmark = pytest.mark.behaviour

RLS = rls_pb2.RateLimitResponse
D = ratelimit_pb2.RateLimitDescriptor
CONFIG = """
    domain: edge
    descriptors:
      - key: client_id
        rate_limit: {{unit: minute, requests_per_unit: {limit}}}
"""


def _payload(client: str, domain: str = "edge") -> bytes:
    entries = [D.Entry(key="client_id", value=client)]
    request = rls_pb2.RateLimitRequest(domain=domain, descriptors=[D(entries=entries)])
    return request.SerializeToString()


def _servicer(tmp_path: Path, limit: int) -> tuple[RateLimitServicer, Limiter]:
    loaded = load_text(tmp_path, CONFIG.format(limit=limit))
    limiter = Limiter(loaded, MemoryStore(), FakeClock())
    return RateLimitServicer(limiter, Telemetry.off()), limiter


async def test_same_payload_counts_every_time(tmp_path: Path) -> None:
    servicer, _ = _servicer(tmp_path, 2)
    codes = [(await asked(servicer, _payload("a"))).overall_code
             for _ in range(3)]  # fmt: skip
    assert codes == [RLS.OK, RLS.OK, RLS.OVER_LIMIT]


async def test_a_payload_takes_its_one_step_from_its_second_call(tmp_path: Path) -> None:
    """A payload seen once is kept without its decision in one step (flows/fast.py): a
    client that asks once never uses it. Seen again, it has one, and keeps it while the
    config stands; a config swap plans it anew, again without one until its next call."""
    servicer, limiter = _servicer(tmp_path, 5)
    payload = _payload("a")
    made = []
    for _ in range(3):
        await asked(servicer, payload)
        made.append(servicer._prepared[payload][1].fast)
    assert made[0] is None and made[1] is not None and made[2] is made[1]
    limiter.swap(load_text(tmp_path, CONFIG.format(limit=5), name="next.yaml"))
    await asked(servicer, payload)
    assert servicer._prepared[payload][1].fast is None
    await asked(servicer, payload)
    assert servicer._prepared[payload][1].fast is not None


async def test_config_swap_replans_a_kept_payload(tmp_path: Path) -> None:
    servicer, limiter = _servicer(tmp_path, 1)
    first = await asked(servicer, _payload("a"))
    assert first.statuses[0].current_limit.requests_per_unit == 1
    limiter.swap(load_text(tmp_path, CONFIG.format(limit=5), name="next.yaml"))
    again = await asked(servicer, _payload("a"))
    assert (again.overall_code, again.statuses[0].current_limit.requests_per_unit) == (RLS.OK, 5)


async def test_invalid_payload_rejected_every_time(tmp_path: Path) -> None:
    servicer, _ = _servicer(tmp_path, 1)
    for _ in range(2):
        with pytest.raises(Aborted) as raised:
            await servicer.ShouldRateLimit(None, CallContext(_payload("a", domain="")))
        assert raised.value.args[0] is grpc.StatusCode.INVALID_ARGUMENT


async def test_a_full_cache_starts_over(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(servicer_module, "PREPARED_CACHE_SIZE", 2)
    servicer, _ = _servicer(tmp_path, 10)
    for client in ("a", "b", "c", "a"):
        answer = await asked(servicer, _payload(client))
        assert answer.overall_code == RLS.OK
    assert len(servicer._prepared) <= 2


async def test_a_call_past_its_deadline_is_shed(tmp_path: Path) -> None:
    """The limit is 1: calls arriving after their deadline are answered OK (failure mode
    open) and charge nothing, so the next call in time is still admitted."""
    servicer, _ = _servicer(tmp_path, 1)
    for _ in range(2):
        late = await asked(servicer, _payload("a"), remaining=0.0)
        assert (late.overall_code, len(late.statuses[0].current_limit.ListFields())) == (RLS.OK, 0)
    in_time = await asked(servicer, _payload("a"), remaining=5.0)
    assert (in_time.overall_code, in_time.statuses[0].limit_remaining) == (RLS.OK, 0)
