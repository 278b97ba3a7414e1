"""Random configs the loader accepts, served, and random hostile requests through a real
gRPC channel (issue 41): every call ends OK with a status per descriptor, or
INVALID_ARGUMENT; never UNKNOWN or INTERNAL (Envoy lets UNKNOWN through), and the server
logs no error. Seeded: the same configs and requests on every run (tests/support/config_fuzz).
"""

import logging
import random
from pathlib import Path

import grpc
import pytest
import yaml

from config_fuzz import draw_accepted, draw_request
from fairlimit._proto.envoy.extensions.common.ratelimit.v3 import ratelimit_pb2
from fairlimit._proto.envoy.service.ratelimit.v3 import rls_pb2, rls_pb2_grpc
from fairlimit.grpc_api.convert import MAX_RESET_SECONDS
from fairlimit.grpc_api.headers import ResponseOptions
from fairlimit.grpc_api.servicer import GrpcServer
from fairlimit.limiter import Limiter
from fairlimit.store.memory import MemoryStore
from fairlimit.telemetry import Telemetry
from helpers import FakeClock, load_text

pytestmark = [pytest.mark.behaviour, pytest.mark.asyncio]

SEEDS = [41, 4141, 414141]
CONFIGS = 20  # accepted configs a seed serves
REQUESTS = 40  # requests a config is sent
RLS = rls_pb2.RateLimitResponse
FINE = (grpc.StatusCode.OK, grpc.StatusCode.INVALID_ARGUMENT)


def _accepted(r: random.Random, path: Path) -> tuple[dict[str, object], Limiter, bool]:
    """The next config of ``r`` the loader accepts, with a limiter over a fresh store, and
    whether that limiter is in shadow mode (--shadow)."""
    config, loaded = draw_accepted(r, path)
    shadow = r.random() < 0.1
    return config, Limiter(loaded, MemoryStore(), FakeClock(), shadow=shadow), shadow


def _plain(config: dict[str, object], shadow: bool, options: ResponseOptions) -> bool:
    """No shadow mode or quota mode anywhere: a status OVER_LIMIT refuses the request."""
    text = yaml.safe_dump(config)
    return not (shadow or "shadow_mode" in text or "quota_mode" in text or options.quota_all)


def _above(status: RLS.DescriptorStatus) -> bool:
    """More left than its limit (a GCRA burst may, a concurrency pool reports slots)."""
    limit = status.current_limit
    return status.HasField("current_limit") and status.limit_remaining > limit.requests_per_unit


async def _serve(limiter: Limiter, options: ResponseOptions) -> GrpcServer:
    server = GrpcServer(limiter, Telemetry.off(), "127.0.0.1:0", options=options)
    await server.start()
    return server


@pytest.mark.parametrize("seed", SEEDS)
async def test_accepted_configs_answer_hostile_requests_with_a_status(
    seed: int, tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    r = random.Random(seed)
    caplog.set_level(logging.ERROR)
    failures: list[str] = []
    for _ in range(CONFIGS):
        config, limiter, shadow = _accepted(r, tmp_path / "d.yaml")
        options = ResponseOptions(
            headers=r.random() < 0.5,
            metadata=r.random() < 0.5,
            rule_names=r.random() < 0.5,
            quota_all=r.random() < 0.2,
        )
        plain = _plain(config, shadow, options)
        counted = not any(w in yaml.safe_dump(config) for w in ("gcra", "concurrency"))
        server = await _serve(limiter, options)
        try:
            async with grpc.aio.insecure_channel(f"127.0.0.1:{server.port}") as channel:
                stub = rls_pb2_grpc.RateLimitServiceStub(channel)
                for _ in range(REQUESTS):
                    request = draw_request(r, config)
                    limiter.clock.advance(r.choice([0.0, 0.3, 61.0]))  # type: ignore[attr-defined]
                    try:
                        answer = await stub.ShouldRateLimit(request, timeout=10)
                    except grpc.aio.AioRpcError as error:
                        if error.code() not in FINE:
                            failures.append(f"{error.code().name} {error.details()}: {request}")
                        continue
                    over = [s.code == RLS.OVER_LIMIT for s in answer.statuses]
                    if len(answer.statuses) != len(request.descriptors):
                        failures.append(f"{len(answer.statuses)} statuses: {request}")
                    elif (answer.overall_code == RLS.OVER_LIMIT) != any(over) and (
                        plain or answer.overall_code == RLS.OVER_LIMIT
                    ):
                        failures.append(f"overall {answer.overall_code} for {over}: {request}")
                    elif counted and any(_above(s) for s in answer.statuses):
                        failures.append(f"more left than the limit: {answer} for {request}")
        finally:
            await server.server.stop(None)
        if failures:
            pytest.fail(yaml.safe_dump(config, allow_unicode=True) + "\n".join(failures[:3]))
    assert not [rec.getMessage() for rec in caplog.records if rec.levelno >= logging.ERROR]


FAR_AHEAD = """
domain: d
descriptors:
  - key: a
    rate_limit: {unit: hour, multiplier: 1000000, requests_per_unit: 3, algorithm: gcra,
                 charge_when_over_limit: true}
"""


async def test_a_bucket_charged_past_int64_seconds_answers_over_limit(tmp_path: Path) -> None:
    """Two charges of 4294967295 on 3 per million hours put the bucket ~1.03e19 s ahead,
    past int64 seconds: the call ended UNKNOWN (found by fuzzing accepted configs). Now
    OVER_LIMIT, reset at Duration's longest."""
    limiter = Limiter(load_text(tmp_path, FAR_AHEAD), MemoryStore(), FakeClock())
    server = await _serve(limiter, ResponseOptions())
    entry = ratelimit_pb2.RateLimitDescriptor.Entry(key="a", value="x")
    try:
        async with grpc.aio.insecure_channel(f"127.0.0.1:{server.port}") as channel:
            stub = rls_pb2_grpc.RateLimitServiceStub(channel)
            for hits in (4294967295, 4294967295, 1):
                descriptor = ratelimit_pb2.RateLimitDescriptor(entries=[entry])
                descriptor.hits_addend.value = hits
                request = rls_pb2.RateLimitRequest(domain="d", descriptors=[descriptor])
                answer = await stub.ShouldRateLimit(request, timeout=10)
                assert answer.overall_code == RLS.OVER_LIMIT
        assert answer.statuses[0].duration_until_reset.seconds == MAX_RESET_SECONDS
    finally:
        await server.server.stop(None)
