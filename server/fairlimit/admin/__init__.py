"""HTTP admin endpoints (aiohttp, on the serve loop): health, metrics, config, ``POST /json``.

``rlqs.py``: the RLQS state as plain data, for the ``rlqs`` part of /rlconfig.
"""

import asyncio
import ipaddress
import json
import math
from collections.abc import Awaitable, Callable, Mapping
from dataclasses import dataclass
from typing import Any

from aiohttp import web
from prometheus_client import CollectorRegistry
from prometheus_client.exposition import CONTENT_TYPE_LATEST, choose_encoder, generate_latest

from fairlimit.core.admission import Code
from fairlimit.core.describe import debug_text, limit_fields
from fairlimit.core.request import Request
from fairlimit.core.rules import Loaded, RateLimit, Rule, walk
from fairlimit.core.validation import Classification, most_severe
from fairlimit.errors import RequestError, StoreUnavailable
from fairlimit.limiter import Decision, Limiter
from fairlimit.telemetry.fairness import CapRow
from fairlimit.telemetry.top import TopRow

MAX_BODY = 64 * 1024  # a RateLimitRequest within the request bounds is far smaller
TOP_DEFAULT = 10  # clients per cap on /top without ?n= and on /rlconfig
_RULES_LISTED = 10  # the rules a /top?rule= that names none lists
# Requests in progress at once besides the probes (/json, /metrics, /rlconfig, /top): a flood
# of them gets 503 while the probes are still answered.
ADMIN_AT_ONCE = 16
PROBES = frozenset({"/healthz", "/healthcheck", "/readyz"})


@dataclass(frozen=True, slots=True)
class JsonCodec:
    """How ``POST /json`` reads a request and writes its answer (proto3 JSON: the app passes
    grpc_api's, so that the wire format is defined in one place)."""

    read_request: Callable[[bytes], Request]  # RequestError when malformed
    write_response: Callable[[Decision, bytes], str]  # the decision, the request's body


class AdminServer:
    """``/healthz``, ``/readyz``, ``/metrics``, ``/rlconfig``, ``/top``, ``/tokens`` and
    ``POST /json``."""

    def __init__(
        self,
        limiter: Limiter,
        host: str,
        port: int,
        codec: JsonCodec,
        registry: CollectorRegistry | None = None,
        *,
        healthy_with_config: bool = False,
        upstream_metrics: Callable[[], str] | None = None,
        rlqs: Callable[[], dict[str, Any]] | None = None,
        timeout: float = 10.0,
        json_from: str = "loopback",
    ) -> None:
        self.limiter = limiter
        self.json_from = json_from  # who may POST /json: loopback, on (anyone) or off
        self.rlqs = rlqs  # the RLQS streams and assignments, for /rlconfig
        self.codec = codec
        self.registry = registry  # the Prometheus reader's, from the CLI's SDK wiring
        self.host, self.port = host, port
        self.draining = False
        self.config_missing = False  # not ready until a domain is loaded (healthy_with_config)
        self.reload_failure: str | None = None  # why the last reload was rejected, if it was
        self.healthy_with_config = healthy_with_config  # HEALTHY_WITH_AT_LEAST_ONE_CONFIG_LOADED
        self.upstream_metrics = upstream_metrics  # envoyproxy/ratelimit's names, when asked
        app = web.Application(client_max_size=MAX_BODY, middlewares=[_Budget().handle])
        app.add_routes(
            [
                web.get("/healthcheck", self.healthcheck),
                web.get("/healthz", self.healthz),
                web.get("/readyz", self.readyz),
                web.get("/metrics", self.metrics),
                web.get("/rlconfig", self.rlconfig),
                web.get("/top", self.top),
                web.get("/tokens", self.tokens),
                web.post("/json", self.json),
            ]
        )
        self.timeout = timeout
        self._runner = _runner(app, timeout)

    async def start(self) -> None:
        await self._runner.setup()
        await web.TCPSite(self._runner, self.host, self.port).start()
        self.port = int(self._runner.addresses[0][1])  # the bound one, when asked for 0

    async def stop(self) -> None:
        await self._runner.cleanup()

    async def healthz(self, request: web.Request) -> web.Response:
        """Alive: the loop answers."""
        return web.Response(text="ok\n")

    async def readyz(self, request: web.Request) -> web.Response:
        """Ready: config loaded, backend answering, not draining.

        A rejected reload is reported in the body but keeps the status 200: the running
        config still limits, and a bad ConfigMap sent to every replica must not take them
        all out of service (fairlimit.config.loads{result="failure"} counts it).
        """
        if self.draining:
            return web.Response(status=503, text="draining\n")
        if self.config_missing:
            return web.Response(status=503, text="no config with a domain loaded yet\n")
        if not await self.limiter.ping():
            return web.Response(status=503, text="backend unavailable\n")
        if self.reload_failure is not None:
            why = self.reload_failure
            return web.Response(text=f"ready; last reload rejected, previous config kept: {why}\n")
        return web.Response(text="ready\n")

    async def healthcheck(self, request: web.Request) -> web.Response:
        """envoyproxy/ratelimit's probe: 200 ``OK``; 500 while draining, or with no domain
        loaded when ``healthy_with_config``. The backend is not pinged: a liveness probe
        that failed with Redis would restart every replica at once."""
        no_config = self.healthy_with_config and not self.limiter.loaded.config.domains
        if self.draining or no_config:
            return web.Response(status=500)
        return web.Response(text="OK")

    async def metrics(self, request: web.Request) -> web.Response:
        """Prometheus text (or OpenMetrics, as the scraper asks) from the OTel SDK's reader.

        With upstream's names on, always Prometheus text 0.0.4, as upstream serves it:
        OpenMetrics would require ``_total`` on the counters that dashboards name without.
        """
        if self.registry is None:
            return web.Response(status=404, text="metrics are not configured\n")
        await self.limiter.refresh_fairness()
        if self.upstream_metrics is not None:
            body = generate_latest(self.registry) + self.upstream_metrics().encode()
            return web.Response(body=body, headers={"Content-Type": CONTENT_TYPE_LATEST})
        encoder, content_type = choose_encoder(request.headers.get("Accept", ""))
        return web.Response(body=encoder(self.registry), headers={"Content-Type": content_type})

    async def rlconfig_text(self, request: web.Request) -> web.Response:
        """The loaded limits, one line each (upstream's debug-port ``/rlconfig``)."""
        return web.Response(text=config_text(self.limiter.loaded))

    async def rlconfig(self, request: web.Request) -> web.Response:
        """The loaded rules, each cap's classification and its live fairness figures; the
        RLQS streams, buckets and assignments under ``rlqs``."""
        rows = await self.limiter.refresh_fairness()
        report = config_report(self.limiter.loaded, rows)
        top = {t.rule: t for t in self.limiter.top_clients(TOP_DEFAULT)}
        for domain in report["domains"]:
            _attach_top(domain["descriptors"], top)
        if self.rlqs is not None:
            report["rlqs"] = self.rlqs()
        return web.json_response(report, dumps=lambda o: json.dumps(o, indent=2))

    async def top(self, request: web.Request) -> web.Response:
        """Each cap's top clients by demand and by rejections (``?n=``, ``?rule=``)."""
        text = request.query.get("n", str(TOP_DEFAULT))
        if not text.isdigit() or int(text) < 1:
            error = f"n: expected a whole number of 1 or more, got {text!r}"
            return web.json_response({"error": error}, status=400)
        capacity = self.limiter.top_capacity
        n = min(int(text), capacity)
        wanted = request.query.get("rule")
        known = list(self.limiter.loaded.verdicts_by_path())
        if wanted is not None and wanted not in known:
            listed = ", ".join(known[:_RULES_LISTED]) + (", ..." if known[_RULES_LISTED:] else "")
            error = f"rule: no cap or global bucket {wanted!r} (there are: {listed or 'none'})"
            return web.json_response({"error": error}, status=404)
        caps = [t.as_json() for t in self.limiter.top_clients(n) if wanted in (None, t.rule)]
        body = {"scope": "process", "capacity": capacity, "n": n, "caps": caps}
        return web.json_response(body, dumps=lambda o: json.dumps(o, indent=2))

    async def tokens(self, request: web.Request) -> web.Response:
        """A client's token budget now (``?domain=``, ``?entry=key=value`` per entry, in
        order, without the request id): charged, reserved, used, owed, remaining."""
        domain = request.query.get("domain", "")
        pairs = [e.partition("=") for e in request.query.getall("entry", [])]
        if not domain or not pairs or any(not sep or not key for key, sep, _ in pairs):
            error = "expected ?domain=D&entry=KEY=VALUE (one entry= per descriptor entry)"
            return web.json_response({"error": error}, status=400)
        entries = tuple([(key, value) for key, _, value in pairs])
        try:
            report = await self.limiter.tokens(domain, entries)
        except StoreUnavailable as exc:
            return web.json_response({"error": f"backend unavailable: {exc}"}, status=503)
        if report is None:
            error = "no rule with a reservation matches these entries"
            return web.json_response({"error": error}, status=404)
        body = {"domain": domain, "entries": [list(e) for e in entries], **report.as_json()}
        return web.json_response(body, dumps=lambda o: json.dumps(o, indent=2))

    async def json(self, request: web.Request) -> web.Response:
        """A RateLimitRequest in proto3 JSON: 200 OK, 429 over, 400 bad, 503 backend down,
        408 when the body takes longer than the timeout.

        It is answered as a gRPC call would be: the hits are counted, real quota is spent.
        So by default it is served only on an admin port bound to a loopback address
        (``--admin-json``): 403 on one bound to any other, 404 with ``off``.
        """
        refused = _json_refusal(self.json_from, self.host)
        if refused is not None:
            return refused
        try:
            body = await asyncio.wait_for(request.read(), self.timeout)
        except TimeoutError:
            return web.json_response({"error": "request body too slow"}, status=408)
        try:
            asked = self.codec.read_request(body)
            decision = await self.limiter.should_rate_limit(asked)
        except RequestError as exc:
            return web.json_response({"error": str(exc)}, status=400)
        except StoreUnavailable as exc:  # --failure-mode closed
            return web.json_response({"error": f"backend unavailable: {exc}"}, status=503)
        # failure-open answers OK with the backend down: 503, with what Envoy got as the body
        status = 503 if decision.backend_failed else 200 if decision.code is Code.OK else 429
        return web.Response(
            status=status,
            text=self.codec.write_response(decision, body),
            content_type="application/json",
        )


def _json_refusal(allowed: str, host: str) -> web.Response | None:
    """The answer to a ``POST /json`` that ``--admin-json`` does not let through on an admin
    port bound to ``host``, or None.

    ``loopback`` trusts the listener, not the peer: under a sidecar (Istio's inbound traffic
    arrives from 127.0.0.6) every peer is a loopback address, while a sidecar forwards
    nothing to a port bound to 127.0.0.1 (issue 38).
    """
    if allowed == "on":
        return None
    if allowed == "off":
        return web.json_response({"error": "POST /json is off (--admin-json off)"}, status=404)
    if loopback_host(host):
        return None
    error = (f"POST /json spends real quota: it is served only on an admin port bound to a "
             f"loopback address (--admin-addr 127.0.0.1:PORT), and this one is bound to "
             f"{host}; --admin-json on serves it on any")  # fmt: skip
    return web.json_response({"error": error}, status=403)


def loopback_host(host: str) -> bool:
    """Whether a listener bound to ``host`` is reachable from this host only."""
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host.split("%")[0]).is_loopback
    except ValueError:
        return False  # a name (resolved at bind time, maybe to more than loopback)


def config_report(loaded: Loaded, rows: tuple[CapRow, ...]) -> dict[str, Any]:
    """``/rlconfig``: every domain's rule tree, with classifications and fairness attached."""
    classes = loaded.verdicts_by_path()  # a cap is classified once per limit
    live = {r.rule: r for r in rows}
    slot_classes = {c.path: c for c in loaded.concurrency}
    return {
        "files": [str(f) for f in loaded.files],
        "warnings": loaded.warnings,
        "notes": loaded.notes,
        "domains": [
            {
                "domain": d.name,
                "file": d.source,
                "descriptors": [_rule(r, classes, live, slot_classes) for r in d.rules],
            }
            for d in sorted(loaded.config.domains.values(), key=lambda d: d.name)
        ],
    }


def _rule(
    rule: Rule,
    classes: dict[str, list[Classification]],
    live: dict[str, CapRow],
    slot_classes: dict[str, Classification],
) -> Any:
    out: dict[str, Any] = {"path": rule.path, "key": rule.key, "value": rule.value}
    verdicts = classes.get(rule.path, [])
    if rule.limits:
        # rate_limit: the first limit, as before (RLQS assigns from it); rate_limits: each
        shown = [_limit(limit, verdicts, index) for index, limit in enumerate(rule.limits)]
        out["rate_limit"], out["rate_limits"] = shown[0], shown
    out["shadow_mode"], out["detailed_metric"] = rule.shadow_mode, rule.detailed_metric
    for flag in ("quota_mode", "value_to_metric", "share_threshold"):
        if getattr(rule, flag):
            out[flag] = True
    if rule.quota_group is not None:
        out["quota_group"] = rule.quota_group
    if rule.metadata:
        out["metadata"] = dict(rule.metadata)
    if rule.fair_share is not None:
        out["fair_share"] = {
            "active_clients": rule.fair_share.active_clients,
            "weights": dict(rule.fair_share.weights),
        }
    if verdicts:
        out["classification"] = _verdict(most_severe(verdicts))
        out["fairness"] = _fairness(live.get(rule.path))
    if rule.concurrency is not None:
        slots = rule.concurrency
        out["concurrency"] = {"max_in_flight": slots.max_in_flight,
                              "max_duration": slots.max_duration}  # fmt: skip
        if rule.path in slot_classes:
            c = slot_classes[rule.path]
            verdict = {"mode": c.mode.value, "warning": c.is_warning, "message": c.message}
            out["concurrency"]["classification"] = verdict
    if rule.children:
        out["descriptors"] = [_rule(c, classes, live, slot_classes) for c in rule.children]
    return out


def _limit(limit: RateLimit, verdicts: list[Classification], index: int) -> dict[str, Any]:
    """One limit of a rule: its fields (core/describe.py), name and replaces; at a cap, the
    classification of this limit."""
    out: dict[str, Any] = limit_fields(limit)
    out.update({"name": limit.name, "replaces": list(limit.replaces)})
    mine = [c for c in verdicts if c.limit == index]
    if mine:
        out["classification"] = _verdict(mine[0])
    return out


def _verdict(c: Classification) -> dict[str, Any]:
    return {"mode": c.mode.value, "warning": c.is_warning, "message": c.message}


def _attach_top(nodes: list[dict[str, Any]], top: dict[str, TopRow]) -> None:
    """Each classified rule of a ``config_report`` tree gets its top clients (``/top``)."""
    for node in nodes:
        row = top.get(node["path"])
        if row is not None:
            shown = row.as_json()
            node["top"] = {k: shown[k] for k in ("seconds", "by_demand", "by_rejections")}
        _attach_top(node.get("descriptors", []), top)


def _fairness(row: CapRow | None) -> dict[str, Any] | None:
    if row is None or row.figures is None:
        return None  # no full period seen yet
    f = row.figures
    return {
        "instances": row.instances,
        "utilization": f.utilization,
        "active_clients": f.active_clients,
        "declared_clients": row.declared_clients,
        "over_declared": row.over_declared,
        "fair_share_level_per_second": None if math.isinf(f.level) else f.level,
        "jain_index": f.jain_index,
        "top_client_share": f.top_client_share,
        "starved_clients": f.starved_clients,
    }


def config_text(loaded: Loaded) -> str:
    """Every limited rule as upstream's debug port writes it, ``PATH: unit=U
    requests_per_unit=N, shadow_mode: B, quota_mode: B``; what upstream cannot say follows
    the limit (``window=5m algorithm=gcra burst=20 calendar=ZONE``, core/describe.py), and
    a rule with several limits has a line for each, ``PATH: rate_limits[I]: unit=...``."""
    lines = []
    for domain in sorted(loaded.config.domains.values(), key=lambda d: d.name):
        for rule, _ in walk(domain.rules):
            limits = rule.limits
            flags = (f", shadow_mode: {str(rule.shadow_mode).lower()}, "
                     f"quota_mode: {str(rule.quota_mode).lower()}\n")  # fmt: skip
            for index, limit in enumerate(limits):
                named = f"rate_limits[{index}]: " if len(limits) > 1 else ""
                lines.append(f"{rule.path}: {named}{debug_text(limit)}{flags}")
    return "".join(lines)


class SideListener:
    """A listener of its own for a few GET routes: upstream's debug port, PROMETHEUS_ADDR."""

    def __init__(
        self,
        host: str,
        port: int,
        routes: Mapping[str, Callable[[web.Request], Any]],
        timeout: float = 10.0,
    ) -> None:
        self.host, self.port = host, port
        app = web.Application(middlewares=[_Budget().handle])
        app.add_routes([web.get(path, handler) for path, handler in routes.items()])
        self._runner = _runner(app, timeout)

    async def start(self) -> None:
        await self._runner.setup()
        await web.TCPSite(self._runner, self.host, self.port).start()
        self.port = int(self._runner.addresses[0][1])

    async def stop(self) -> None:
        await self._runner.cleanup()


def _runner(app: web.Application, timeout: float) -> web.AppRunner:
    # aiohttp's keep-alive timer also runs from a connection's start until a request's
    # headers are complete: set to ``timeout``, it closes a connection that sends its
    # headers too slowly (or none), where its default would wait an hour.
    return web.AppRunner(app, access_log=None, keepalive_timeout=timeout)


class _Budget:
    """An admin listener's own budget: at most ADMIN_AT_ONCE requests in progress besides
    the probes, which are always answered; beyond, 503."""

    def __init__(self) -> None:
        self.busy = 0

    @web.middleware
    async def handle(
        self, request: web.Request, handler: Callable[[web.Request], Awaitable[web.StreamResponse]]
    ) -> web.StreamResponse:
        if request.path in PROBES:
            return await handler(request)
        if self.busy >= ADMIN_AT_ONCE:
            text = f"{ADMIN_AT_ONCE} admin requests in progress, the most at once\n"
            return web.Response(status=503, text=text)
        self.busy += 1
        try:
            return await handler(request)
        finally:
            self.busy -= 1
