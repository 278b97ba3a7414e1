"""A management server for xDS tests: an ADS server on loopback that sends what a test queues
and records every request it gets (tests/grpc_api/test_xds.py, tests/e2e/)."""

import queue
import threading
import time
from collections.abc import Iterator
from concurrent import futures
from pathlib import Path
from typing import Any

import grpc
from google.protobuf import any_pb2

from fairlimit._proto.envoy.service.discovery.v3 import ads_pb2_grpc, discovery_pb2
from fairlimit.grpc_api.xds import TYPE_URL
from helpers import STARTUP_SECONDS


def response(version: str, *configs: Any) -> Any:
    resources = []
    for config in configs:
        packed = any_pb2.Any()
        packed.Pack(config)
        resources.append(packed)
    return discovery_pb2.DiscoveryResponse(
        version_info=version, resources=resources, type_url=TYPE_URL, nonce=f"n{version}"
    )


class ManagementServer(ads_pb2_grpc.AggregatedDiscoveryServiceServicer):
    """An ADS server that sends what a test queues, and records every request it gets."""

    def __init__(self, tls: dict[str, Path] | None = None) -> None:
        """``tls``: serve over mTLS with these files (the tls_files fixture)."""
        self.to_send: queue.Queue[Any] = queue.Queue()
        self.received: queue.Queue[Any] = queue.Queue()
        self.server = grpc.server(futures.ThreadPoolExecutor(max_workers=4))
        ads_pb2_grpc.add_AggregatedDiscoveryServiceServicer_to_server(self, self.server)
        if tls is None:
            self.port = self.server.add_insecure_port("127.0.0.1:0")
        else:
            pair = (tls["server.key"].read_bytes(), tls["server.crt"].read_bytes())
            credentials = grpc.ssl_server_credentials(
                [pair], tls["ca.crt"].read_bytes(), require_client_auth=True
            )
            self.port = self.server.add_secure_port("127.0.0.1:0", credentials)
        self.server.start()
        self.metadata: dict[str, str] = {}

    def StreamAggregatedResources(self, requests: Iterator[Any], context: Any) -> Iterator[Any]:
        self.metadata = dict(context.invocation_metadata())
        reader = threading.Thread(target=self._read, args=(requests,), daemon=True)
        reader.start()
        while context.is_active():
            try:
                yield self.to_send.get(timeout=0.1)  # a poll, so that a closed stream ends
            except queue.Empty:
                continue

    def _read(self, requests: Iterator[Any]) -> None:
        try:
            for request in requests:
                self.received.put(request)
        except grpc.RpcError:
            pass  # the client closed the stream

    def request(self) -> Any:
        return self.received.get(timeout=20)

    def push(self, version: str, *configs: Any) -> None:
        """A snapshot: every resource, as the state of the world at ``version``."""
        self.to_send.put(response(version, *configs))

    def acked(self, version: str) -> Any:
        """The next request that ACKs ``version`` (those before it are passed over; a NACK
        fails)."""
        deadline = time.monotonic() + STARTUP_SECONDS
        while time.monotonic() < deadline:
            request = self.request()
            assert not request.HasField("error_detail"), request.error_detail.message
            if request.version_info == version:
                return request
        raise AssertionError(f"version {version} was never ACKed")

    def stop(self) -> None:
        self.server.stop(0)
