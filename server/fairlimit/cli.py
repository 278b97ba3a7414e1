"""The ``fairlimit`` command: serve, check, simulate, top, version. Logging is set up here only."""

import argparse
import asyncio
import json
import logging
import os
import signal
import sys
from collections.abc import Sequence
from pathlib import Path
from typing import TYPE_CHECKING

from fairlimit import __version__
from fairlimit.config.loader import load
from fairlimit.core.rules import Loaded
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


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="fairlimit", description=__doc__)
    parser.add_argument("--version", action="version", version=f"fairlimit {__version__}")
    sub = parser.add_subparsers(dest="command", required=True)
    serve = sub.add_parser("serve", help="serve Envoy's RateLimitService")
    serve.add_argument("--config", action="append", metavar="PATH", help="file or directory")
    serve.add_argument("--backend", help="memory:// (default), redis://, rediss://, ...")
    serve.add_argument("--grpc-addr", metavar="HOST:PORT")
    serve.add_argument("--admin-addr", metavar="HOST:PORT")
    serve.add_argument("--strict", action="store_const", const=True)
    serve.add_argument(
        "--failure-mode", choices=["open", "closed", "local"],
        help="backend unavailable: answer OK (open, default), UNAVAILABLE (closed), or limit "
        "alone to this process's part of every limit (local)",
    )  # fmt: skip
    serve.add_argument(
        "--replicas", metavar="N",
        help="pods sharing the backend (--failure-mode local divides each limit by N x "
        "--workers, or by the processes last seen when more); 0: those last seen",
    )  # fmt: skip
    serve.add_argument("--shadow", action="store_const", const=True)
    serve.add_argument("--workers", metavar="N")
    serve.add_argument("--max-connection-age", metavar="SECONDS",
                       help="GOAWAY after this long (0: never), so clients rebalance")  # fmt: skip
    serve.add_argument("--max-connection-age-grace", metavar="SECONDS",
                       help="time calls in flight get after GOAWAY")  # fmt: skip
    serve.add_argument(
        "--allow-empty-config", action="store_const", const=True,
        help="accept a config without any rate limit (refused by default)",
    )  # fmt: skip
    serve.add_argument(
        "--healthy-with-config", action="store_const", const=True,
        help="not ready (nor healthy) until a config with a domain is loaded",
    )  # fmt: skip
    serve.add_argument("--log-format", choices=["text", "json"])
    serve.add_argument("--log-level", choices=["debug", "info", "warning", "error"])
    serve.add_argument("--tls-cert", metavar="PEM", help="serve gRPC over TLS with this chain")
    serve.add_argument("--tls-key", metavar="PEM", help="the private key of --tls-cert")
    serve.add_argument("--tls-client-ca", metavar="PEM", help="require client certs (mTLS)")
    serve.add_argument("--top-clients", metavar="K", help="clients tracked per cap for /top")
    serve.add_argument(
        "--grpc-max-receive-bytes",
        metavar="N",
        help="largest gRPC message (default 262144; 0: the largest the request bounds admit)",
    )
    serve.add_argument(
        "--grpc-max-concurrent",
        metavar="N",
        help="rate-limit calls at once; more get RESOURCE_EXHAUSTED (default 32)",
    )
    serve.add_argument(
        "--rlqs-max-streams",
        metavar="N",
        help="RLQS streams open at once; more get RESOURCE_EXHAUSTED (default 64)",
    )
    serve.add_argument(
        "--grpc-max-streams-per-connection",
        metavar="N",
        help="HTTP/2 streams one client connection may have open (default 16)",
    )
    serve.add_argument(
        "--grpc-read-timeout",
        metavar="SECONDS",
        help="a call whose (first) message has not arrived by then ends with "
        "DEADLINE_EXCEEDED (default 1)",
    )
    serve.add_argument(
        "--admin-json",
        choices=["loopback", "on", "off"],
        help="who may POST /json, which spends real quota: loopback peers (default), "
        "anyone who reaches the admin port, or nobody",
    )
    serve.add_argument(
        "--admin-timeout",
        metavar="SECONDS",
        help="admin HTTP: the longest a client may take to send headers or a body (10)",
    )
    serve.add_argument(
        "--drain-delay",
        metavar="SECONDS",
        help="on SIGTERM, answer this long while health says NOT_SERVING",
    )
    check = sub.add_parser("check", help="validate and classify descriptor files")
    check.add_argument("paths", nargs="+", metavar="PATH")
    check.add_argument("--strict", action="store_true", help="warnings are errors")
    check.add_argument("--format", choices=["text", "json"], default="text")
    simulate = sub.add_parser("simulate", help="run a traffic scenario on a simulated clock")
    simulate.add_argument("scenario", metavar="SCENARIO")
    simulate.add_argument(
        "--config", action="append", metavar="PATH", default=[], help="instead of its configs"
    )
    simulate.add_argument(
        "--plot", metavar="OUT.png", help="draw admitted hits per group against the cap and λ"
    )
    simulate.add_argument("--format", choices=["text", "json"], default="text")
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
                      metrics_dir=metrics_dir)  # fmt: skip
        except ConfigError as exc:
            for line in exc.problems:
                logging.getLogger("fairlimit").error("%s", line)
            logging.getLogger("fairlimit").error("config rejected: refusing to start")
            return EXIT_UNUSABLE
        await app.run()
        return EXIT_OK

    try:
        return asyncio.run(serve())
    finally:
        sdk.shutdown()


def _check_report(loaded: Loaded, strict: bool) -> dict[str, object]:
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
        }
        for c in loaded.classifications
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
        "notes": loaded.notes,
    }


def _check(args: argparse.Namespace) -> int:
    try:
        loaded = load(args.paths)
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
    for c in (*loaded.classifications, *loaded.concurrency):
        level = "error" if strict and c.is_warning else "warning" if c.is_warning else (
            "note" if c.is_note else "ok")  # fmt: skip
        levels.append(level)
        print(f"{level}: {c.line}")
    modes = [c.mode.value for c in (*loaded.classifications, *loaded.concurrency)]
    summary = ", ".join(f"{modes.count(m)} {m}" for m in sorted(set(modes))) or "no limits"
    print(f"{len(loaded.files)} files, {len(loaded.config.domains)} domains: {summary}")
    for level, text in _EXPLAINED.items():
        if level in levels:
            print(text)


def _simulate(args: argparse.Namespace) -> int:
    from fairlimit.simulate import load_scenario, plot, report, run  # only this command

    try:
        if args.plot:
            plot.plotting()  # before the run: a missing extra is unusable input
    except ModuleNotFoundError as exc:
        print(f"fairlimit: {exc}", file=sys.stderr)
        return EXIT_UNUSABLE
    try:
        result = run(load_scenario(args.scenario), args.config)
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
