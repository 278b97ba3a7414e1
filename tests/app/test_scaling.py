"""Scaling out: ``--workers N`` shows every worker in ``/metrics``; connection ageing flags."""

import time
import urllib.request
from pathlib import Path

import grpc
import pytest
from prometheus_client import CollectorRegistry, Counter, generate_latest
from prometheus_client.parser import text_string_to_metric_families

from fairlimit._proto.envoy.extensions.common.ratelimit.v3 import ratelimit_pb2
from fairlimit._proto.envoy.service.ratelimit.v3 import rls_pb2, rls_pb2_grpc
from fairlimit.errors import SettingsError
from fairlimit.settings import Settings
from fairlimit.telemetry import pooled
from redis_servers import RedisProcess
from servers import ServerProcess

CONFIG = """\
domain: edge
descriptors:
  - key: client_id
    rate_limit: {unit: minute, requests_per_unit: 1000}
"""
CONNECTIONS = 24  # one call each: the kernel spreads the connections over the workers
CALLS = "fairlimit_rpc_duration_seconds_count"


def _calls_by_worker(admin_port: int) -> dict[str, float]:
    url = f"http://127.0.0.1:{admin_port}/metrics"
    with urllib.request.urlopen(url, timeout=5) as response:
        text = response.read().decode()
    out: dict[str, float] = {}
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            if sample.name == CALLS:
                worker = sample.labels["worker"]
                out[worker] = out.get(worker, 0.0) + sample.value
    return out


@pytest.mark.process
def test_metrics_show_every_worker(redis_server: RedisProcess, tmp_path: Path) -> None:
    config = tmp_path / "edge.yaml"
    config.write_text(CONFIG)
    server = ServerProcess(["--config", str(config), "--backend", redis_server.url + "?timeout=0.5",
                            "--workers", "2"])  # fmt: skip
    options = [("grpc.use_local_subchannel_pool", 1)]  # a connection per channel
    entry = ratelimit_pb2.RateLimitDescriptor.Entry(key="client_id", value="metrics")
    message = rls_pb2.RateLimitRequest(
        domain="edge", descriptors=[ratelimit_pb2.RateLimitDescriptor(entries=[entry])]
    )
    try:
        deadline = time.monotonic() + 30
        while "".join(server.lines).count("serving gRPC on") < 2:  # both workers listen
            assert time.monotonic() < deadline, "".join(server.lines)
            time.sleep(0.05)
        for _ in range(CONNECTIONS):
            with grpc.insecure_channel(server.target, options) as channel:
                rls_pb2_grpc.RateLimitServiceStub(channel).ShouldRateLimit(message, timeout=10)
        deadline = time.monotonic() + 30  # worker 1 hands its metrics over every second
        seen = _calls_by_worker(server.admin_port)
        while sum(seen.values()) < CONNECTIONS and time.monotonic() < deadline:
            time.sleep(0.2)  # polls; asserts no duration
            seen = _calls_by_worker(server.admin_port)
    finally:
        assert server.stop() == 0
    assert set(seen) == {"0", "1"}
    assert sum(seen.values()) == CONNECTIONS


@pytest.mark.unit
class TestPooled:
    def test_other_workers_dumps_are_labelled_and_kept_apart(self, tmp_path: Path) -> None:
        registries = [CollectorRegistry() for _ in range(3)]
        for index, registry in enumerate(registries):
            Counter("calls", "Calls", registry=registry).inc(index + 1)
        for index in (1, 2):
            pooled.dump(registries[index], tmp_path, index)
        text = generate_latest(pooled.pooled_registry(registries[0], tmp_path)).decode()
        totals = {s.labels["worker"]: s.value
                  for family in text_string_to_metric_families(text)
                  for s in family.samples if s.name == "calls_total"}  # fmt: skip
        assert totals == {"0": 1.0, "1": 2.0, "2": 3.0}


@pytest.mark.unit
class TestConnectionAge:
    def test_flags_and_environment(self) -> None:
        assert Settings().max_connection_age is None  # connections are kept by default
        given = Settings().override({"max_connection_age": "60", "max_connection_age_grace": "2"})
        assert (given.max_connection_age, given.max_connection_age_grace) == (60, 2)
        env = Settings.from_env({"FAIRLIMIT_MAX_CONNECTION_AGE": "30"})
        assert env.max_connection_age == 30

    def test_rejects_what_is_not_seconds(self) -> None:
        with pytest.raises(SettingsError, match="--max-connection-age"):
            Settings().override({"max_connection_age": "soon"})
