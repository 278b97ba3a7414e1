"""The ``fairlimit`` command: serve, check, simulate, top, version. Logging is set up here only."""

import argparse
import asyncio
import json
import logging
import os
import signal
import sys
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path
from typing import TYPE_CHECKING

from fairlimit import __version__
from fairlimit.config.loader import load
from fairlimit.core.describe import has_plain_limits, limit_fields, limit_words
from fairlimit.core.rules import Loaded, RateLimit, Rule
from fairlimit.core.validation import Classification, uncapped_rules
from fairlimit.errors import ConfigError, ConfigUnreadable, SettingsError, UnsupportedBackend

if TYPE_CHECKING:
    from fairlimit.settings import Settings

EXIT_OK, EXIT_VIOLATION, EXIT_UNUSABLE = 0, 1, 2


class _JsonFormatter(logging.Formatter):
    def format(self, record: logging.LogRecord) -> str:
        return json.dumps(
            {
                "time": self.formatTime(record),
                "level": record.levelname.lower(),
                "logger": record.name,
                "message": record.getMessage(),
            }
        )


# Upstream's levels (logrus) that Python's logging does not name.
_LEVELS = {"trace": "DEBUG", "warn": "WARNING", "fatal": "CRITICAL", "panic": "CRITICAL"}


def _configure_logging(fmt: str, level: str = "info") -> None:
    handler = logging.StreamHandler(sys.stderr)
    if fmt == "json":
        handler.setFormatter(_JsonFormatter())
    else:
        handler.setFormatter(logging.Formatter("%(asctime)s %(levelname)s %(name)s: %(message)s"))
    name = _LEVELS.get(level, level.upper())
    logging.basicConfig(level=name, handlers=[handler], force=True)


_DESCRIPTION = """\
An Envoy-compatible gRPC rate-limit server: per-client buckets under fair, hierarchical
caps, a drop-in for envoyproxy/ratelimit. `fairlimit serve` runs it; `fairlimit check`
validates descriptor files first. Docs: docs/getting-started.md."""

_SERVE = """\
Serve Envoy's RateLimitService (gRPC) and the admin HTTP port (/healthz, /readyz,
/metrics, /rlconfig, /top, POST /json). It is up when `curl -fs http://ADMIN/readyz`
answers (ADMIN is --admin-addr). Every flag has an environment twin, FAIRLIMIT_ and the
flag's name (--grpc-addr is FAIRLIMIT_GRPC_ADDR); envoyproxy/ratelimit's variables
(GRPC_PORT, RUNTIME_ROOT, REDIS_URL, ...) are read too, below them."""


def _serve_parser(sub: "argparse._SubParsersAction[argparse.ArgumentParser]") -> None:
    from fairlimit.settings import Settings  # the defaults shown are the settings' own

    d = Settings()
    serve = sub.add_parser(
        "serve", help="serve Envoy's RateLimitService", description=_SERVE,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )  # fmt: skip
    add = serve.add_argument
    add("--config", action="append", metavar="PATH",
        help="a descriptor file, or a directory of *.yaml/*.yml; repeatable (default: the "
        "bundled descriptors/)")  # fmt: skip
    add("--backend", metavar="URL",
        help=f"where counters live: memory://, redis://HOST:PORT, rediss://, "
        f"redis+sentinel://, redis+cluster:// (default {d.backend})")  # fmt: skip
    add("--grpc-addr", metavar="HOST:PORT",
        help=f"gRPC listen address, or unix:PATH (default {d.grpc_addr})")  # fmt: skip
    add("--admin-addr", metavar="HOST:PORT",
        help=f"admin HTTP listen address (default {d.admin_addr})")  # fmt: skip
    add("--strict", action="store_const", const=True,
        help="refuse a config whose caps draw a warning (default: warn and load)")  # fmt: skip
    add("--failure-mode", choices=["open", "closed", "local"],
        help="while the backend is down: open answers OK, closed UNAVAILABLE, local "
        "limits alone to this process's part of every limit "
        f"(default {d.failure_mode.value})")  # fmt: skip
    add("--replicas", metavar="N",
        help="pods sharing the backend (--failure-mode local divides each limit by N x "
        f"--workers, or by the processes last seen when more); 0: those last seen "
        f"(default {d.replicas})")  # fmt: skip
    add("--shadow", action="store_const", const=True,
        help="decide and count, but answer every call OK (default: off)")  # fmt: skip
    add("--workers", metavar="N",
        help=f"processes sharing the gRPC port; more than 1 needs a Redis backend "
        f"(default {d.workers})")  # fmt: skip
    add("--max-connection-age", metavar="SECONDS",
        help="GOAWAY after this long, so clients rebalance (default: never)")  # fmt: skip
    add("--max-connection-age-grace", metavar="SECONDS",
        help="time calls in flight get after GOAWAY (default: unbounded)")  # fmt: skip
    add("--allow-empty-config", action="store_const", const=True,
        help="accept a config without any rate limit (default: refused)")  # fmt: skip
    add("--healthy-with-config", action="store_const", const=True,
        help="not ready (nor healthy) until a config with a domain is loaded "
        "(default: off)")  # fmt: skip
    add("--force-start", action="store_const", const=True,
        help="with xDS, serve at once instead of after the first config "
        "(FORCE_START_WITHOUT_INITIAL_CONFIG; default: off)")  # fmt: skip
    add("--charge-when-over-limit", choices=["true", "false"],
        help="what a rate_limit without charge_when_over_limit does: true, every hit "
        "counts, refused or not (envoyproxy/ratelimit's); false, a refused request "
        "consumes nothing (default: true for xDS and under envoyproxy/ratelimit's "
        "variables, false otherwise)")  # fmt: skip
    add("--rule-names", choices=["true", "false"],
        help="name each status by its rule (Envoy's quota policy name=), add "
        "RateLimit-Policy and RateLimit headers and the fairlimit metadata (default: false "
        "for xDS and under envoyproxy/ratelimit's layout, true otherwise)")  # fmt: skip
    add("--log-format", choices=["text", "json"], help=f"(default {d.log_format})")
    add("--log-level", choices=["debug", "info", "warning", "error"],
        help=f"(default {d.log_level})")  # fmt: skip
    add("--tls-cert", metavar="PEM", help="serve gRPC over TLS with this chain (default: "
        "plaintext)")  # fmt: skip
    add("--tls-key", metavar="PEM", help="the private key of --tls-cert")
    add("--tls-client-ca", metavar="PEM",
        help="require client certificates signed by this CA (mTLS)")  # fmt: skip
    add("--top-clients", metavar="K",
        help=f"clients tracked per cap for /top and fairlimit top; 0: off "
        f"(default {d.top_clients})")  # fmt: skip
    add("--grpc-max-receive-bytes", metavar="N",
        help=f"largest gRPC message; 0: the largest the request bounds admit "
        f"(default {d.grpc_max_receive_bytes})")  # fmt: skip
    add("--grpc-max-concurrent", metavar="N",
        help=f"rate-limit calls at once; more get RESOURCE_EXHAUSTED "
        f"(default {d.grpc_max_concurrent})")  # fmt: skip
    add("--rlqs-max-streams", metavar="N",
        help=f"RLQS streams open at once; more get RESOURCE_EXHAUSTED "
        f"(default {d.rlqs_max_streams})")  # fmt: skip
    add("--rlqs-max-buckets-per-stream", metavar="N",
        help=f"RLQS buckets one stream may hold; a new one past it gets no assignment "
        f"(default {d.rlqs_max_buckets_per_stream})")  # fmt: skip
    add("--rlqs-max-buckets", metavar="N",
        help=f"RLQS buckets all streams together may hold; a new one past it gets no "
        f"assignment (default {d.rlqs_max_buckets})")  # fmt: skip
    add("--grpc-max-streams-per-connection", metavar="N",
        help=f"HTTP/2 streams one client connection may have open; 0: no limit. Streams "
        f"a new connection opens past it before reading it are reset, and Envoy lets "
        f"those requests through (default {d.grpc_max_streams_per_connection})")  # fmt: skip
    add("--grpc-read-timeout", metavar="SECONDS",
        help=f"a call whose (first) message has not arrived by then ends with "
        f"DEADLINE_EXCEEDED (default {d.grpc_read_timeout:g})")  # fmt: skip
    add("--admin-json", choices=["loopback", "on", "off"],
        help=f"where POST /json, which spends real quota, is served: only on an admin port "
        f"bound to a loopback address, on any, or nowhere (default {d.admin_json})")  # fmt: skip
    add("--admin-timeout", metavar="SECONDS",
        help=f"admin HTTP: the longest a client may take to send headers or a body "
        f"(default {d.admin_timeout:g})")  # fmt: skip
    add("--drain-delay", metavar="SECONDS",
        help=f"on SIGTERM, answer this long while health says NOT_SERVING "
        f"(default {d.drain_delay:g})")  # fmt: skip


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="fairlimit", description=_DESCRIPTION,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )  # fmt: skip
    parser.add_argument("--version", action="version", version=f"fairlimit {__version__}")
    sub = parser.add_subparsers(dest="command", required=True)
    _serve_parser(sub)
    check = sub.add_parser("check", help="validate and classify descriptor files")
    check.add_argument("paths", nargs="+", metavar="PATH")
    check.add_argument("--strict", action="store_true", help="warnings are errors")
    check.add_argument("--format", choices=["text", "json"], default="text",
                       help="the report's form (default text)")  # fmt: skip
    check.add_argument(
        "--merge-domains", action="store_true",
        help="merge files of one domain, as serve does under MERGE_DOMAIN_CONFIG or "
        "FAIRLIMIT_MERGE_DOMAINS (both read here too)",
    )  # fmt: skip
    simulate = sub.add_parser("simulate", help="run a traffic scenario on a simulated clock")
    simulate.add_argument("scenario", metavar="SCENARIO")
    simulate.add_argument(
        "--config", action="append", metavar="PATH", default=[], help="instead of its configs"
    )
    simulate.add_argument(
        "--plot", metavar="OUT.png", help="draw admitted hits per group against the cap and λ"
    )
    simulate.add_argument("--format", choices=["text", "json"], default="text",
                          help="the report's form (default text)")  # fmt: skip
    simulate.add_argument("--phase", type=float, metavar="F",
                          help="start every repeating phase (page loads) at F (0 to below 1) "
                          "of its second")  # fmt: skip
    top = sub.add_parser("top", help="a live view of each cap's top clients (admin /top)")
    top.add_argument("--admin-addr", metavar="HOST:PORT", help="the server's admin address")
    top.add_argument("-n", type=int, default=10, metavar="N", help="clients per cap")
    top.add_argument("--rule", metavar="PATH", help="only this cap (rule path)")
    top.add_argument("--sort", choices=["demand", "rejections"], default="demand")
    top.add_argument("--interval", type=float, default=1.0, metavar="SECONDS")
    top.add_argument("--once", action="store_true", help="print one snapshot and exit")
    sub.add_parser("version", help="print the version")
    return parser


def _serve(args: argparse.Namespace) -> int:
    # First: a SIGHUP (a reload) that comes while the server starts would end the process
    # by default; the config about to be loaded is the current one anyway. The serve loop
    # (or the --workers parent) installs the real handler.
    signal.signal(signal.SIGHUP, signal.SIG_IGN)
    from fairlimit.settings import Settings

    given = {k: v for k, v in vars(args).items() if k != "command" and v is not None}
    settings = Settings.from_env(os.environ).override(given)
    _configure_logging(settings.log_format, settings.log_level)
    warning = settings.upstream_warning()
    if warning is not None:
        logging.getLogger("fairlimit").warning("%s", warning)
    if settings.workers > 1:
        from fairlimit.workers import run_workers

        return run_workers(settings, _serve_worker)
    return _serve_settings(settings)


def _serve_worker(settings: "Settings", index: int) -> None:
    """One of ``--workers N`` (a spawned process): serve, the admin HTTP only in worker 0."""
    _configure_logging(settings.log_format, settings.log_level)
    try:
        code = _serve_settings(settings, worker=index)
    except (SettingsError, UnsupportedBackend) as exc:  # the store checks --backend in each worker
        code = _unusable(exc)
    raise SystemExit(code)


def _serve_settings(settings: "Settings", worker: int = 0) -> int:
    from fairlimit.app import App  # grpc is imported only when serving
    from fairlimit.telemetry import pooled
    from fairlimit.telemetry import sdk as otel_sdk

    sdk = otel_sdk.install(os.environ)  # the OpenTelemetry SDK, here and nowhere else
    shared = os.environ.get(pooled.DIRECTORY_ENV) if settings.workers > 1 else None
    metrics_dir = Path(shared) if shared else None

    async def serve() -> int:
        try:  # inside the loop: grpc.aio binds to the running loop
            app = App(settings, metrics_registry=sdk.registry, worker=worker,
                      metrics_dir=metrics_dir, rpc_latency=sdk.latency)  # fmt: skip
        except ConfigError as exc:
            for line in exc.problems:
                logging.getLogger("fairlimit").error("%s", line)
            logging.getLogger("fairlimit").error("config rejected: refusing to start")
            return EXIT_UNUSABLE
        await app.run()
        return EXIT_OK

    try:
        with asyncio.Runner(loop_factory=loop_factory()) as runner:
            return runner.run(serve())
    finally:
        sdk.shutdown()


def loop_factory() -> Callable[[], asyncio.AbstractEventLoop] | None:
    """uvloop's event loop where it is installed (a dependency on Linux and macOS): a call
    costs 16-33 µs less CPU on it than on asyncio's own (bench/ladder.py); else asyncio's."""
    try:
        import uvloop
    except ImportError:
        return None
    return uvloop.new_event_loop


def _limits_judged(c: Classification, rule: Rule) -> list[RateLimit]:
    """The limits of ``rule`` its verdict ``c`` is about: a cap's, the one it classifies (a
    cap is classified once per limit); a global bucket's, every limit it counts."""
    return list(rule.limits) if c.limit is None else [rule.limits[c.limit]]


def _verdicts(loaded: Loaded) -> list[Classification]:
    """What check reports on rates: the caps and global buckets the server classifies, then
    the rules outside any cap it does not (a bucket per client), so every limit is counted."""
    return [*loaded.classifications, *uncapped_rules(loaded.config)]


def _check_report(loaded: Loaded, strict: bool) -> dict[str, object]:
    rules = loaded.config.rules_by_path()
    verdicts = _verdicts(loaded)
    caps = [
        {
            "file": c.source,
            "path": c.path,
            "mode": c.mode.value,
            "warning": c.is_warning,
            "note": c.is_note,
            "message": c.message,
            "cap_per_second": c.cap_per_second,
            "required_per_second": c.required_per_second,
            "per_client_per_second": c.per_client_per_second,
            "active_clients": c.active_clients,
            "limits": [limit_fields(limit) for limit in _limits_judged(c, rules[c.path])],
        }
        for c in verdicts
    ]
    slots = [
        {
            "path": c.path,
            "mode": c.mode.value,
            "warning": c.is_warning,
            "message": c.message,
            "max_in_flight": int(c.cap_per_second),
            "required_in_flight": c.required_per_second,
            "active_clients": c.active_clients,
        }
        for c in loaded.concurrency
    ]
    warnings = loaded.warnings
    return {
        "ok": not (strict and warnings),
        "files": [str(f) for f in loaded.files],
        "domains": sorted(loaded.config.domains),
        "classifications": caps,
        "concurrency": slots,
        "errors": warnings if strict else [],
        "warnings": [] if strict else warnings,
        "notes": [c.line for c in (*verdicts, *loaded.concurrency) if c.is_note],
    }


def _check_settings(environ: Mapping[str, str]) -> "Settings":
    """The settings that decide how serve would load the files, read as serve reads them:
    MERGE_DOMAIN_CONFIG and RUNTIME_IGNOREDOTFILES, then their FAIRLIMIT_* twins (the
    others, addresses and backends, are no business of check's)."""
    from fairlimit.settings import Settings
    from fairlimit.settings.upstream import go_bool

    values: dict[str, str] = {}
    sources: dict[str, str] = {}
    for upstream, name in (("MERGE_DOMAIN_CONFIG", "merge_domains"),
                           ("RUNTIME_IGNOREDOTFILES", "ignore_dotfiles")):  # fmt: skip
        own = f"FAIRLIMIT_{name.upper()}"
        if own in environ:
            values[name], sources[name] = environ[own], own
        elif upstream in environ:
            values[name] = str(go_bool(upstream, environ[upstream])).lower()
            sources[name] = upstream
    return Settings().override(values, sources)


def _check(args: argparse.Namespace) -> int:
    settings = _check_settings(os.environ)
    try:
        loaded = load(
            args.paths,
            merge_domains=args.merge_domains or settings.merge_domains,
            ignore_dotfiles=settings.ignore_dotfiles,
        )
    except ConfigError as exc:
        code = EXIT_UNUSABLE if isinstance(exc, ConfigUnreadable) else EXIT_VIOLATION
        if args.format == "json":
            print(json.dumps({"ok": False, "errors": exc.problems, "classifications": []}))
        else:
            for line in exc.problems:
                print(line, file=sys.stderr)
        return code
    report = _check_report(loaded, args.strict)
    if args.format == "json":
        print(json.dumps(report, indent=2))
    else:
        _check_text(loaded, args.strict)
    return EXIT_OK if report["ok"] else EXIT_VIOLATION


_EXPLAINED = {
    "note": "notes: a global bucket works as in envoyproxy/ratelimit (first come, first "
    "served); it is advice, never an error, --strict included",
    "warning": "warnings: a contended cap is shared by weighted max-min fairness; raise the "
    "cap or lower the per-client limits or active_clients to make it per-client buckets; "
    "--strict refuses it",
    "error": "errors: --strict refuses a contended cap; raise the cap or lower the "
    "per-client limits or active_clients, or drop --strict to share it fairly",
}


def _check_text(loaded: Loaded, strict: bool) -> None:
    levels = []
    rules = loaded.config.rules_by_path()
    judged = [(c, rules.get(c.path)) for c in _verdicts(loaded)]
    for c, rule in [*judged, *((c, None) for c in loaded.concurrency)]:
        level = "error" if strict and c.is_warning else "warning" if c.is_warning else (
            "note" if c.is_note else "ok")  # fmt: skip
        levels.append(level)
        print(f"{level}: {c.line}")
        if rule is not None and not has_plain_limits(rule):  # as before for upstream's own
            limits = _limits_judged(c, rule)
            named = "limit" if len(limits) == 1 else "limits"
            print(f"    {named}: " + "; ".join(limit_words(limit) for limit in limits))
    modes = [c.mode.value for c, _ in judged] + [c.mode.value for c in loaded.concurrency]
    summary = ", ".join(f"{modes.count(m)} {m}" for m in sorted(set(modes))) or "no limits"
    print(f"{len(loaded.files)} files, {len(loaded.config.domains)} domains: {summary}")
    for level, text in _EXPLAINED.items():
        if level in levels:
            print(text)


def _simulate(args: argparse.Namespace) -> int:
    from fairlimit.simulate import load_scenario, plot, report, run  # only this command
    from fairlimit.simulate.scenario import at_phase

    try:
        if args.plot:
            plot.plotting()  # before the run: a missing extra is unusable input
    except ModuleNotFoundError as exc:
        print(f"fairlimit: {exc}", file=sys.stderr)
        return EXIT_UNUSABLE
    try:
        scenario = load_scenario(args.scenario)
        if args.phase is not None:
            scenario = at_phase(scenario, args.phase)
        result = run(scenario, args.config)
    except ConfigError as exc:  # ScenarioError included
        for line in exc.problems:
            print(line, file=sys.stderr)
        return EXIT_UNUSABLE
    if args.format == "json":
        print(json.dumps(report.as_json(result), indent=2))
    else:
        print(report.text(result))
    if args.plot:
        try:
            plot.plot(result, args.plot)
        except OSError as exc:
            print(f"fairlimit: cannot write {args.plot}: {exc}", file=sys.stderr)
            return EXIT_UNUSABLE
    return EXIT_OK


def _top(args: argparse.Namespace) -> int:
    from fairlimit import topview
    from fairlimit.settings import Settings, parse_address

    addr = args.admin_addr or Settings.from_env(os.environ).admin_addr
    parse_address("--admin-addr", addr)
    url = topview.url_of(addr, max(1, args.n), args.rule)
    try:
        return topview.run(
            url, sort=args.sort, once=args.once, interval=args.interval, out=sys.stdout
        )
    except topview.Unreachable as exc:
        print(f"fairlimit top: {exc}", file=sys.stderr)
        return EXIT_UNUSABLE
    except KeyboardInterrupt:
        return EXIT_OK
    except BrokenPipeError:  # `fairlimit top | head`: the reader has what it wanted
        # what is still buffered would fail again at exit: stdout goes nowhere instead
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
        return EXIT_OK


def main(argv: Sequence[str] | None = None) -> int:
    """Run the CLI; returns the process exit code."""
    args = _parser().parse_args(argv)
    try:
        if args.command == "serve":
            return _serve(args)
        if args.command == "check":
            return _check(args)
        if args.command == "simulate":
            return _simulate(args)
        if args.command == "top":
            return _top(args)
        print(f"fairlimit {__version__}")
        return EXIT_OK
    except (SettingsError, UnsupportedBackend) as exc:
        return _unusable(exc)


def _unusable(exc: SettingsError | UnsupportedBackend) -> int:
    """Print a settings error; the store's own error does not know the flag that named it."""
    flag = "--backend: " if isinstance(exc, UnsupportedBackend) else ""
    print(f"fairlimit: {flag}{exc}", file=sys.stderr)
    return EXIT_UNUSABLE


if __name__ == "__main__":  # pragma: no cover
    raise SystemExit(main())
