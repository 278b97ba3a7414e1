"""The benchmark's table, from the results dict bench/run.py also writes as JSON."""

from typing import Any

TARGETS = (
    ("noop", "(a) no-op grpc.aio (ceiling)"),
    ("memory", "(b) fairlimit memory://"),
    ("redis", "(c) redis:// leases=off"),
    ("redis-w2", "(d) leases=off --workers 2"),
    ("redis-lease", "(e) redis:// leases, fair cap"),
    ("redis-2r", "(f) 2 replicas, leases, cap"),
)


def _ms(x: float | None) -> str:
    return "-" if x is None else f"{x:.2f}"


def _ratio(x: float, ceiling: float | None) -> str:
    return f"{x / ceiling:.2f}x" if ceiling else "-"


def _grpc_rows(results: dict[str, Any]) -> list[str]:
    targets = results.get("targets", {})
    ceiling = targets.get("noop", {})
    lines = [f"{'target':<32}{'workload':<30}{'req/s':>9}{'p50 ms':>9}{'p99 ms':>9}{'vs (a)':>8}",
             "-" * 97]  # fmt: skip
    workloads = (("hot", "1 hot client, h2load"),
                 ("hot_half_ceiling", "1 hot client @ half ceiling"),
                 ("hot_half_own", "1 hot client @ half own max"),
                 ("many_clients", f"{results.get('many', '10k')} clients, loadgen"))  # fmt: skip
    for key, workload in workloads:
        base = ceiling.get(key, {}).get("rps")
        for name, label in TARGETS:
            row = targets.get(name, {}).get(key)
            if row is None:
                continue
            lines.append(f"{label:<32}{workload:<30}{row['rps']:>9.0f}{_ms(row['p50_ms']):>9}"
                         f"{_ms(row['p99_ms']):>9}{_ratio(row['rps'], base):>8}")  # fmt: skip
    rounds = [f"{name} {targets[name]['hot'].get('rounds_rps')}" for name, _ in TARGETS
              if "rounds_rps" in targets.get(name, {}).get("hot", {})]  # fmt: skip
    if rounds:
        lines.append(
            "1 hot client, req/s of each round (the median is shown): " + "; ".join(rounds)
        )
    return lines


def _redis_rows(results: dict[str, Any]) -> list[str]:
    lines = []
    for name, label in TARGETS[1:]:
        m = results.get("targets", {}).get(name, {}).get("server_metrics")
        if m:
            lines.append(
                f"{label}: {m['backend_errors']:.0f} backend errors and "
                f"{m.get('shed', 0):.0f} shed calls (deadline passed) in "
                f"{m['rpc_calls']:.0f} calls (failure mode open: answered OK)"
            )
    shared = results.get("targets", {}).get("redis-2r", {}).get("shared")
    if shared:
        verdict = "within it" if shared["admitted"] <= shared["limit"] else "OVER IT"
        lines.append(f"(f) 2 replicas, one limit of {shared['limit']} an hour: "
                     f"{shared['admitted']:.0f} admitted of {shared['requests']} requests "
                     f"({verdict})")  # fmt: skip
    for name, label in TARGETS[1:]:
        own = results.get("targets", {}).get(name, {}).get("hot_half_own") or {}
        noop = own.get("noop_same_rate")
        if noop:
            lines.append(f"{label}: p99 at half its own max {_ms(own['p99_ms'])} ms vs the "
                         f"no-op's {_ms(noop['p99_ms'])} ms at the same rate "
                         f"({own['p99_ms'] / noop['p99_ms']:.2f}x; target <= 1.5x)")  # fmt: skip
        at80 = results.get("targets", {}).get(name, {}).get("hot_80_own")
        if at80:
            split = ""
            if "shed" in at80:  # since issue 41: which kind, and each worker's calls
                split = (f" ({at80['backend_errors']:.0f} backend errors, {at80['shed']:.0f} "
                         "shed)")  # fmt: skip
                if len(at80.get("calls_by_worker", [])) > 1:
                    calls = " / ".join(f"{c:.0f}" for c in at80["calls_by_worker"])
                    split += f", calls per worker {calls} (its connections spread by the kernel)"
            lines.append(f"{label}: at 80% of its own max ({at80['rps']:.0f} req/s): "
                         f"{at80['fail_open']:.0f} answers by the failure mode{split}, "
                         f"p99 {_ms(at80['p99_ms'])} ms")  # fmt: skip
    for name, label in TARGETS[2:]:
        row = results.get("targets", {}).get(name)
        if not row:
            continue
        lines.append(f"{label}: hot client admitted: {row.get('redis_calls_per_request')} "
                     f"script calls and {row.get('redis_round_trips_per_request')} Redis reads "
                     "(round trips) per request")  # fmt: skip
        if "lease" in name or "2r" in name:
            calls = row.get("redis_calls_per_request") or 0.0
            lines.append(f"{label}: lease hit rate {1 - calls:.3f} (requests answered from a "
                         "local block, with no Redis call)")  # fmt: skip
        storm = row.get("retry_storm")
        if storm:
            lines.append(f"{label}: retry storm (10/min client, {storm['done']} requests at "
                         f"{storm['rps']:.0f} req/s): {storm['redis_script_calls']} script calls "
                         f"= {storm['redis_calls_per_request']} per request")  # fmt: skip
    return lines


def _envoy_rows(results: dict[str, Any]) -> list[str]:
    env = results.get("envoy")
    if not env or "envoy" not in env:
        return []
    alone, both, noop = env["envoy"], env["envoy+fairlimit"], env.get("envoy+noop")
    rlqs = env.get("envoy+fairlimit-rlqs")
    lines = []
    rows = (("Envoy alone", alone), ("Envoy + no-op RLS", noop),
            ("Envoy + fairlimit memory://", both),
            ("Envoy + fairlimit over RLQS", rlqs))  # fmt: skip
    for label, row in rows:
        if row is None:
            continue
        full, paced = row["full"], row["paced"]
        lines.append(f"{label:<30} {full['rps']:>8.0f} req/s (p99 {_ms(full['p99_ms'])} ms);"
                     f" at {paced['rate']} req/s: p50 {_ms(paced['p50_ms'])} ms,"
                     f" p99 {_ms(paced['p99_ms'])} ms, non-2xx {paced['non_2xx']}")  # fmt: skip
    added = both["paced"]["p99_ms"] - alone["paced"]["p99_ms"]
    lines.append(f"fairlimit adds {added:.2f} ms p99 at {both['paced']['rate']} req/s; "
                 f"Envoy + fairlimit = {both['full']['rps'] / alone['full']['rps']:.2f}x "
                 "Envoy alone's req/s")  # fmt: skip
    if noop is not None:
        lines.append(f"Envoy + fairlimit = {both['full']['rps'] / noop['full']['rps']:.2f}x "
                     "Envoy + no-op RLS's req/s (target >= 0.8x); p99 at the same rate "
                     f"{both['paced']['p99_ms'] / noop['paced']['p99_ms']:.2f}x"
                     " the no-op's")  # fmt: skip
    if rlqs is not None:
        lines.append(f"Envoy + fairlimit over RLQS (no call per request) = "
                     f"{rlqs['full']['rps'] / alone['full']['rps']:.2f}x Envoy alone's req/s; "
                     f"p99 at {rlqs['paced']['rate']} req/s "
                     f"{rlqs['paced']['p99_ms'] - alone['paced']['p99_ms']:+.2f} ms")  # fmt: skip
    return lines


def _inproc_rows(results: dict[str, Any]) -> list[str]:
    lines = []
    own = results.get("servicer")
    if own:
        lines.append(f"fairlimit's own work per call (bytes in to bytes out, memory store, "
                     f"telemetry on, no gRPC): {own['us_per_request']:.1f} µs")  # fmt: skip
    for row in results.get("lambda", {}).get("rows", []):
        lines.append(f"λ recompute, {row['clients']:>7} clients: water_level "
                     f"{row['water_level_ms']:.1f} ms, with fairness figures "
                     f"{row['with_figures_ms']:.1f} ms")  # fmt: skip
    clients = results.get("clients")
    if clients:
        for row in clients["rows"]:
            new = "-" if row["new_client_us"] is None else f"{row['new_client_us']:.1f}"
            lines.append(f"memory store, {row['live_clients']:>7} live clients: known client "
                         f"{row['known_client_us']:.1f} µs/request, new client {new} µs/request,"
                         f" store {row['store_bytes'] / 1e6:.1f} MB")  # fmt: skip
        tm = clients["tracemalloc_check"]
        lines.append(
            f"memory per client: {clients['bytes_per_client']:.0f} B (store accounting),"
            f" {tm['bytes_per_client']:.0f} B (tracemalloc, {tm['clients']} clients)"
        )
        lines.append(f"after {clients['clients']} clients expired: store "
                     f"{clients['after_expiry_bytes']} B vs {clients['base_bytes']} B before "
                     f"({clients['after_vs_base']:.2f}x);"
                     f" tracemalloc: {tm['after_minus_base_bytes']:+d} B")  # fmt: skip
    return lines


LIMIT_RULES = (
    ("unlimited", "0 limits (unlimited rule)"),
    ("limits-1", "1 limit"),
    ("limits-3", "3 limits"),
    ("capped-1", "1 limit under a cap"),
    ("capped-3", "3 limits under a cap"),
)


def _per_extra(rows: dict[str, Any], key: str, fmt: str) -> str:
    """What each limit past the first adds, plain and under a cap: (3 limits - 1) / 2."""
    parts = []
    for one, three in (("limits-1", "limits-3"), ("capped-1", "capped-3")):
        if one in rows and three in rows:
            parts.append(format((rows[three][key] - rows[one][key]) / 2, "+" + fmt))
    return " / ".join(parts)


def limits_rows(results: dict[str, Any]) -> list[str]:
    """bench/limits.py's figures: several limits on one rule, beside the ceilings."""
    lim = results.get("limits", results)
    memory, redis, grpc = lim.get("memory"), lim.get("redis"), lim.get("grpc")
    lines: list[str] = []
    if memory or redis:
        lines.append(f"several limits on one rule, in-process, µs per request (best of "
                     f"{lim['passes']} passes of {lim['memory_size']} on memory, "
                     f"{lim['redis_size']} on Redis, one request in flight)")  # fmt: skip
        lines.append(f"{'rule':<28}{'memory':>8}{'Redis wall':>12}{'CPU here':>10}"
                     f"{'in Redis':>10}{'calls/req':>11}{'cmds/req':>10}")  # fmt: skip
        lines.append("-" * 89)
        nothing = (redis or {}).get("script-return-1")
        if nothing:
            lines.append(f"{'script `return 1` (ceiling)':<28}{'-':>8}{nothing['wall_us']:>12.1f}"
                         f"{nothing['cpu_us']:>10.1f}{nothing['redis_us']:>10.1f}"
                         f"{nothing['script_calls_per_request']:>11.3f}"
                         f"{nothing['commands_per_request']:>10.2f}")  # fmt: skip
        for route, label in LIMIT_RULES:
            m = (memory or {}).get(route)
            r = (redis or {}).get(route)
            mem = f"{m['us_per_request']:.2f}" if m else "-"
            if r:
                rest = (f"{r['wall_us']:>12.1f}{r['cpu_us']:>10.1f}{r['redis_us']:>10.1f}"
                        f"{r['script_calls_per_request']:>11.3f}"
                        f"{r['commands_per_request']:>10.2f}")  # fmt: skip
            else:
                rest = ""
            lines.append(f"{label:<28}{mem:>8}{rest}")
        extra = [f"memory {_per_extra(memory, 'us_per_request', '.2f')} µs"] if memory else []
        if redis:
            extra += [f"Redis wall {_per_extra(redis, 'wall_us', '.1f')} µs",
                      f"CPU here {_per_extra(redis, 'cpu_us', '.1f')} µs",
                      f"in Redis {_per_extra(redis, 'redis_us', '.1f')} µs",
                      f"script calls {_per_extra(redis, 'script_calls_per_request', '.3f')}",
                      f"commands {_per_extra(redis, 'commands_per_request', '.2f')}"]  # fmt: skip
        lines.append("each limit past the first (plain / under a cap): " + ", ".join(extra))
        refused = [f"{part} {route}: {row['not_admitted']}"
                   for part in ("memory", "redis") for route, row in (lim.get(part) or {}).items()
                   if row.get("not_admitted")]  # fmt: skip
        if refused:
            lines.append("NOT ADMITTED (refused or failure mode): " + "; ".join(refused))
    if grpc:
        base = grpc.get("noop", {}).get("rps")
        lines.append("")
        lines.append("several limits on one rule, gRPC (h2load, 1 hot client, 16 connections "
                     "x 2 streams), CPU µs per request of the target, of redis-server")  # fmt: skip
        lines.append(f"{'target':<34}{'req/s':>7}"
                     f"{'p50 ms':>8}{'p99 ms':>8}{'vs no-op':>9}{'CPU µs/req':>11}"
                     f"{'Redis CPU':>10}{'calls/req':>10}{'cmds/req':>9}")  # fmt: skip
        lines.append("-" * 106)
        for label, row in grpc.items():
            shown = "no-op grpc.aio (ceiling)" if label == "noop" else f"fairlimit {label}"
            on_redis = ""
            if "redis_cpu_us" in row:
                on_redis = (f"{row['redis_cpu_us']:>10.1f}{row['script_calls_per_request']:>10.3f}"
                            f"{row['commands_per_request']:>9.2f}")  # fmt: skip
            lines.append(f"{shown:<34}{row['rps']:>7.0f}{_ms(row['p50_ms']):>8}"
                         f"{_ms(row['p99_ms']):>8}{_ratio(row['rps'], base):>9}"
                         f"{row['cpu_us']:>11.1f}{on_redis}")  # fmt: skip
        rounds = "; ".join(f"{label} {row['rounds_rps']}" for label, row in grpc.items())
        lines.append(f"req/s of each round (the median round is shown; CPU: the least "
                     f"round): {rounds}")  # fmt: skip
    lines += [f"note: {n}" for n in lim.get("notes", [])]
    return lines


def _ladder_rows(results: dict[str, Any]) -> list[str]:
    if "ladder" not in results:
        return []
    from ladder import table as ladder_table  # bench/ladder.py, beside this file

    return ladder_table(results["ladder"])


def table(results: dict[str, Any]) -> str:
    machine = results.get("machine", {})
    model = next((s for s in machine.get("lscpu", []) if s.startswith("Model name")), "")
    load = [round(x, 2) for x in machine.get("loadavg_before", ())]
    head = [f"machine: {model.split(':', 1)[-1].strip()}, nproc {machine.get('nproc')}, "
            f"load average before {load}, CPU during the run "
            f"{machine.get('cpu_during_run')}", ""]  # fmt: skip
    parts = [
        head,
        _grpc_rows(results),
        [""],
        _redis_rows(results),
        [""],
        _envoy_rows(results),
        [""],
        _inproc_rows(results),
        [""],
        limits_rows(results) if "limits" in results else [],
        [""],
        _ladder_rows(results),
        [""] + [f"note: {n}" for n in results.get("notes", [])],
    ]
    return "\n".join(line for part in parts for line in part).rstrip()
