"""What the live fairness tests share: two replicas on one Redis, and the rate-limit call
they make, one client under the `fair` domain's `route=api` cap (fairness_cases.flat_config),
over a real gRPC stub."""

from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

from fairlimit._proto.envoy.extensions.common.ratelimit.v3 import ratelimit_pb2
from fairlimit._proto.envoy.service.ratelimit.v3 import rls_pb2, rls_pb2_grpc
from redis_servers import RedisProcess
from servers import ServerProcess, replicas_of

Entry = ratelimit_pb2.RateLimitDescriptor.Entry


def request(client: str) -> rls_pb2.RateLimitRequest:
    entries = [Entry(key="route", value="api"), Entry(key="client_id", value=client)]
    return rls_pb2.RateLimitRequest(
        domain="fair", descriptors=[ratelimit_pb2.RateLimitDescriptor(entries=entries)]
    )


async def ask(stub: rls_pb2_grpc.RateLimitServiceStub, client: str) -> bool:
    """Whether ``client``'s call is admitted (5 s to answer)."""
    reply = await stub.ShouldRateLimit(request(client), timeout=5)
    return bool(reply.overall_code == rls_pb2.RateLimitResponse.OK)


@contextmanager
def replicas_on(redis: RedisProcess, workdir: Path, config: str) -> Iterator[list[ServerProcess]]:
    """Two fairlimit processes serving ``config`` on ``redis``, emptied first."""
    with redis.client() as client:
        client.flushall()
    path = workdir / "fair.yaml"
    path.write_text(config)
    with replicas_of(path, redis.url + "?timeout=1") as servers:
        yield servers
