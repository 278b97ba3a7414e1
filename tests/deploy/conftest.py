"""Fixtures of the deployment specs: helm (in a scratch home), envoy, a recording RLS."""

from collections.abc import Iterator
from concurrent import futures

import grpc
import pytest

from envoy_proxy import envoy_binary
from fairlimit._proto.envoy.service.ratelimit.v3 import rls_pb2_grpc
from helpers import require

from .helpers import Helm
from .processes import StubRateLimitService


@pytest.fixture(scope="module")
def helm(tmp_path_factory: pytest.TempPathFactory) -> Helm:
    path = require("helm", "bash tests/run.sh installs helm v3 into .tools/bin")
    return Helm(path, tmp_path_factory.mktemp("helm"))


@pytest.fixture(scope="module")
def envoy() -> str:
    """The envoy binary; a skip where it is missing, a failure in CI."""
    return envoy_binary()


@pytest.fixture
def stub_rls() -> Iterator[tuple[StubRateLimitService, int]]:
    service = StubRateLimitService()
    server = grpc.server(futures.ThreadPoolExecutor(max_workers=2))
    rls_pb2_grpc.add_RateLimitServiceServicer_to_server(service, server)
    port = server.add_insecure_port("127.0.0.1:0")
    server.start()
    yield service, port
    server.stop(grace=None)
