"""Descriptor configs pushed by an xDS management server, as envoyproxy/ratelimit takes them.

``CONFIG_TYPE=GRPC_XDS_SOTW``: one ADS stream (state of the world) asking for
``RateLimitConfig`` resources, one per domain. Each response is the whole configuration: it
is loaded all or nothing like the files, then ACKed (its version and nonce echoed), or NACKed
with the problems as the error detail while the running config stays. A set that limits
nothing is applied like any other, as upstream applies it: Envoy Gateway sends one when a
Gateway has no rate-limit policy (none yet, or the last one deleted). A lost stream is
reopened after a pause, and the management server sends the current set again.
``XdsConfigSource`` is xDS's ``ConfigSource`` (``config/source.py``).
"""

import asyncio
import logging
from collections.abc import AsyncIterator, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import grpc
from google.protobuf import json_format

from fairlimit._proto.envoy.service.discovery.v3 import ads_pb2_grpc, discovery_pb2
from fairlimit._proto.ratelimit.config.ratelimit.v3 import rls_conf_pb2
from fairlimit.config.loader import assemble, parse_root
from fairlimit.config.source import Apply, Reject
from fairlimit.config.yaml_text import Plain
from fairlimit.core.rules import Domain, Loaded
from fairlimit.errors import ConfigError
from fairlimit.settings.xds import XdsSection, XdsTlsFiles

log = logging.getLogger(__name__)

TYPE_URL = "type.googleapis.com/ratelimit.config.ratelimit.v3.RateLimitConfig"
_INVALID_ARGUMENT = 3  # google.rpc.Code of a NACK's error detail


@dataclass(frozen=True, slots=True)
class XdsTls:
    """TLS to the management server (PEM contents); a client certificate makes it mTLS."""

    server_ca: bytes | None = None  # None: the system's roots
    client_cert: bytes | None = None
    client_key: bytes | None = None
    server_name: str | None = None  # the name to verify instead of the target's host

    @classmethod
    def read(cls, files: XdsTlsFiles) -> "XdsTls":
        """The files' contents, read now (once, at start)."""

        def read(path: Path | None) -> bytes | None:
            return None if path is None else path.read_bytes()

        return cls(read(files.server_ca), read(files.client_cert), read(files.client_key),
                   files.server_name)  # fmt: skip

    def channel(self, target: str) -> grpc.aio.Channel:
        credentials = grpc.ssl_channel_credentials(
            self.server_ca, self.client_key, self.client_cert
        )
        options = [] if not self.server_name else [
            ("grpc.ssl_target_name_override", self.server_name)]  # fmt: skip
        return grpc.aio.secure_channel(target, credentials, options)


def _flag(value: bool) -> Plain:
    return Plain("true" if value else "false")


def _policy(policy: Any) -> dict[str, object]:
    if policy.unlimited:
        out: dict[str, object] = {"unlimited": _flag(True)}
    else:
        unit = rls_conf_pb2.RateLimitUnit.Name(policy.unit)
        out = {"unit": unit, "requests_per_unit": Plain(str(policy.requests_per_unit))}
    if policy.name:
        out["name"] = policy.name
    if policy.replaces:
        out["replaces"] = [{"name": r.name} for r in policy.replaces]
    return out


def _descriptor(node: Any) -> dict[str, object]:
    out: dict[str, object] = {"key": node.key, "value": node.value or None}
    if node.HasField("rate_limit"):
        out["rate_limit"] = _policy(node.rate_limit)
    for flag in ("shadow_mode", "detailed_metric", "quota_mode"):
        out[flag] = _flag(getattr(node, flag))
    if node.HasField("metadata"):
        out["metadata"] = json_format.MessageToDict(node.metadata)
    if node.descriptors:
        out["descriptors"] = [_descriptor(child) for child in node.descriptors]
    return out


def config_root(config: Any) -> dict[str, object]:
    """A RateLimitConfig as the loader reads a file: the same keys, scalars as text."""
    return {"domain": config.domain, "descriptors": [_descriptor(d) for d in config.descriptors]}


def load_resources(
    resources: Sequence[Any], *, strict: bool = False, merge_domains: bool = False,
    charge_over_limit: bool = True,
) -> Loaded:  # fmt: skip
    """A response's resources -> the Loaded config, all or nothing (ConfigError); a set that
    limits nothing (no resource at all, say) is a config like any other.

    A RateLimitConfig cannot say ``charge_when_over_limit``: by default every hit counts,
    refused or not, as upstream counts them (``charge_over_limit``)."""
    domains: list[Domain] = []
    problems: list[str] = []
    for index, resource in enumerate(resources):
        config = rls_conf_pb2.RateLimitConfig()
        if not resource.Unpack(config):
            problems.append(f"resource {index}: (file): not a RateLimitConfig: {resource.type_url}")
            continue
        try:
            domains.append(parse_root(config_root(config), config.name or f"resource {index}"))
        except ConfigError as exc:
            problems.extend(exc.problems)
    if problems:
        raise ConfigError(problems)
    return assemble(
        domains, (), strict=strict, merge_domains=merge_domains,
        charge_over_limit=charge_over_limit,
    )  # fmt: skip


class XdsConfigSource:
    """Keeps the running config in step with the management server until ``stop``."""

    def __init__(
        self,
        settings: XdsSection,
        *,
        strict: bool,
        merge_domains: bool,
        apply: Apply,
        reject: Reject,
        charge_over_limit: bool = True,
    ) -> None:
        self.settings = settings
        self.name = f"xDS server {settings.target}"
        self.tls = None if settings.tls is None else XdsTls.read(settings.tls)
        self.strict, self.merge_domains = strict, merge_domains
        self.charge_over_limit = charge_over_limit
        self._apply, self._reject = apply, reject
        self._stop = asyncio.Event()
        self.applied = asyncio.Event()  # set once a first config was accepted
        self.version = ""  # the version last applied, echoed in NACKs

    def initial(self) -> None:
        """None: nothing until the management server sends the first set."""
        return None

    async def reload(self) -> bool:
        """Nothing to do: the management server pushes every change itself."""
        return False

    def _node(self) -> dict[str, object]:
        return {"id": self.settings.node_id, "metadata": dict(self.settings.node_metadata)}

    def _request(self, response: Any = None, error: str | None = None) -> Any:
        request = discovery_pb2.DiscoveryRequest(
            version_info=self.version, node=self._node(), type_url=TYPE_URL
        )
        if response is not None:
            request.response_nonce = response.nonce
        if error is not None:
            request.error_detail.code = _INVALID_ARGUMENT
            request.error_detail.message = error
        return request

    def _answer(self, response: Any) -> Any:
        """Load ``response``; the ACK or NACK to send back."""
        try:
            loaded = load_resources(
                response.resources, strict=self.strict, merge_domains=self.merge_domains,
                charge_over_limit=self.charge_over_limit,
            )  # fmt: skip
        except ConfigError as exc:
            self._reject(exc)
            return self._request(response, "\n".join(exc.problems))
        self.version = response.version_info
        self._apply(loaded)
        self.applied.set()
        return self._request(response)

    async def _stream(self, channel: grpc.aio.Channel) -> None:
        outgoing: asyncio.Queue[Any] = asyncio.Queue()
        outgoing.put_nowait(self._request())

        async def requests() -> AsyncIterator[Any]:
            while True:
                yield await outgoing.get()

        stub = ads_pb2_grpc.AggregatedDiscoveryServiceStub(channel)
        call = stub.StreamAggregatedResources(requests(), metadata=self.settings.headers or None)
        async for response in call:
            if response.type_url == TYPE_URL:
                outgoing.put_nowait(self._answer(response))

    async def run(self) -> None:
        """Follow the management server, reconnecting after a pause, until ``stop``."""
        while not self._stop.is_set():
            async with self._channel() as channel:
                streaming = asyncio.ensure_future(self._stream(channel))
                stopping = asyncio.ensure_future(self._stop.wait())
                await asyncio.wait({streaming, stopping}, return_when=asyncio.FIRST_COMPLETED)
                stopping.cancel()
                if not streaming.done():
                    streaming.cancel()
                await asyncio.gather(streaming, return_exceptions=True)
                if streaming.cancelled() or self._stop.is_set():
                    continue
                error = streaming.exception()
                log.error("xDS stream to %s ended: %s", self.settings.target, error or "closed")
            try:
                await asyncio.wait_for(self._stop.wait(), self.settings.retry_seconds)
            except TimeoutError:
                continue

    def _channel(self) -> grpc.aio.Channel:
        tls = self.tls
        target = self.settings.target
        return grpc.aio.insecure_channel(target) if tls is None else tls.channel(target)

    def stop(self) -> None:
        self._stop.set()
