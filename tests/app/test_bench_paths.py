"""The benchmark's in-process paths still run against the code they measure.

bench/run.py measures; these only run its in-process pieces once, so that a change of the
servicer or the limiter that breaks them (the servicer came to read its message from the
call, on a task: the bench drove it bare and stopped with "no running event loop") fails
here rather than in the next benchmark run. No figure is judged.
"""

import pytest

from helpers import bench_module

pytestmark = pytest.mark.unit


@pytest.fixture
def inproc():  # type: ignore[no-untyped-def]
    with bench_module("inproc") as module:
        yield module


def test_the_servicer_path_runs(inproc) -> None:  # type: ignore[no-untyped-def]
    result = inproc.servicer_cost()
    assert set(result) == {"us_per_request"} and result["us_per_request"] > 0


def test_the_recompute_path_runs(inproc) -> None:  # type: ignore[no-untyped-def]
    assert inproc.lambda_recompute(sizes=(100,))


def test_the_noop_answers_as_fairlimit_does(inproc) -> None:  # type: ignore[no-untyped-def]
    """Envoy + the no-op is Envoy + fairlimit's ceiling only if Envoy has the same answer to
    handle (its x-ratelimit-* headers come from a status's limit): ``noop.py --answer
    statuses`` is fairlimit's first answer to the hot client on route=public, byte for byte."""
    import asyncio

    import noop
    from wire import message

    from fairlimit._proto.envoy.service.ratelimit.v3 import rls_pb2
    from fairlimit.app.build import response_options
    from fairlimit.config.loader import load
    from fairlimit.grpc_api.servicer import RateLimitServicer
    from fairlimit.limiter import Limiter
    from fairlimit.settings import Settings
    from fairlimit.store.memory import MemoryStore
    from fairlimit.telemetry import Telemetry

    limiter = Limiter(load([inproc.CONFIG]), MemoryStore(), telemetry=Telemetry.off())
    options = response_options(Settings())  # `serve`'s defaults
    servicer = RateLimitServicer(limiter, Telemetry.off(), options)
    context = inproc._Context()
    context.body = message("public", "hot")

    async def ask() -> bytes:  # on a task, as grpc.aio runs each call
        return await servicer.ShouldRateLimit(None, context)

    answer = rls_pb2.RateLimitResponse.FromString(asyncio.run(ask()))
    # the reset is what is left of the window: whole seconds from a window of one second
    answer.statuses[0].duration_until_reset.Clear()
    answer.statuses[0].duration_until_reset.seconds = 1
    assert answer.SerializeToString() == noop.statuses_response()


def test_the_cold_calls_run(inproc) -> None:  # type: ignore[no-untyped-def]
    """bench/cold_calls.py: each step of the call, warm and cooled, on both routes."""
    import cold_calls

    rows = cold_calls.measure(["plain", "public"], calls=3, objects=10, pieces=True)
    steps = ("the call", "limiter.decide", "response built, serialized", "latency recorded")
    expected = [(route, what) for route in ("plain", "public") for what in steps]
    assert [(row["route"], row["what"]) for row in rows] == expected
    assert all(float(row["warm_us"]) > 0 and float(row["cooled_us"]) > 0 for row in rows)
