"""The service's own instruments, about calls and the backend rather than rules: the
ShouldRateLimit latency histogram (``fairlimit.rpc.duration``, recorded through the SDK only
where ``telemetry.latency`` does not keep it), ``fairlimit.rpc.shed``, ``.failed_open``,
``.refused``, ``.in_progress`` and ``.decided_locally``, ``fairlimit.backend.errors`` and
``.degraded`` (a gauge), and ``fairlimit.config.loads``."""

from collections.abc import Callable, Iterable

from opentelemetry.metrics import CallbackOptions, Meter, Observation

from fairlimit.telemetry import latency


class CallInstruments:
    """The instruments; ``Telemetry`` records into them, catching what they raise."""

    def __init__(self, meter: Meter, *, sdk_latency: bool) -> None:
        """``sdk_latency``: record the latency histogram through the SDK (``record_latency``)."""
        if sdk_latency:
            self._rpc = meter.create_histogram(
                latency.NAME,
                latency.UNIT,
                latency.DESCRIPTION,
                explicit_bucket_boundaries_advisory=latency.BOUNDS,
            )
        self._rpc_attributes: dict[str, dict[str, str]] = {}
        self.backend_errors = meter.create_counter(
            "fairlimit.backend.errors", "{error}", "Store calls that failed (StoreUnavailable)"
        )
        self.shed = meter.create_counter(
            "fairlimit.rpc.shed",
            "{call}",
            "Calls answered by the failure mode because their deadline passed (or left the "
            "backend no time)",
        )
        self.failed_open = meter.create_counter(
            "fairlimit.rpc.failed_open",
            "{call}",
            "Calls answered OK without a decision because the backend was unavailable "
            "(--failure-mode open): no limit was in force for them",
        )
        self.refused = meter.create_counter(
            "fairlimit.rpc.refused",
            "{call}",
            "gRPC calls refused before their message was served, by kind (rate-limit calls, "
            "RLQS streams, other calls) and reason (busy: the kind's budget was full, and "
            "so was its queue, or the call waited --grpc-read-timeout for a place; evicted: "
            "stalled, still waiting for its message, it gave its place to a waiting call "
            "(docs/failure-modes.md); read_timeout: the message did not arrive within "
            "--grpc-read-timeout)",
        )
        # where fairlimit.rpc.in_progress reads its figures: (kind, calls) pairs
        self.in_progress: Callable[[], Iterable[tuple[str, int]]] = tuple
        meter.create_observable_gauge(
            "fairlimit.rpc.in_progress",
            [self._calls_in_progress],
            "{call}",
            "gRPC calls in progress by kind (rls, rlqs, other), against the budgets "
            "--grpc-max-concurrent and --rlqs-max-streams",
        )
        self.decided_locally = meter.create_counter(
            "fairlimit.rpc.decided_locally",
            "{call}",
            "Calls decided by this process alone, to its part of every limit, because the "
            "backend was unavailable (--failure-mode local)",
        )
        self.degraded = 0
        meter.create_observable_gauge(
            "fairlimit.backend.degraded",
            [self._degraded_now],
            "1",
            "1 while this process limits alone because the backend was unavailable "
            "(--failure-mode local), until what it admitted is written back and its part has "
            "bounded it for a second more",
        )
        # Exported at 0 from the start: an alert on rate() needs the series before the first
        # incident, and a missing series reads as "no data", not as "never".
        self.failed_open.add(0)
        self.shed.add(0)
        for kind in ("rls", "rlqs"):  # what FairlimitCallBudgetFull watches
            self.refused.add(0, {"kind": kind, "reason": "busy"})
        self.decided_locally.add(0)
        self.loads = meter.create_counter(
            "fairlimit.config.loads", "{load}", "Config loads, by result (success|failure)"
        )

    def record_latency(self, seconds: float, result: str) -> None:
        """One call into the SDK's histogram (made only with ``sdk_latency``)."""
        attributes = self._rpc_attributes.get(result)
        if attributes is None:  # one per code name: the SDK copies what it keeps
            attributes = self._rpc_attributes[result] = {"result": result}
        self._rpc.record(seconds, attributes)

    def _calls_in_progress(self, options: CallbackOptions) -> Iterable[Observation]:
        return [Observation(calls, {"kind": kind}) for kind, calls in self.in_progress()]

    def _degraded_now(self, options: CallbackOptions) -> Iterable[Observation]:
        return [Observation(self.degraded)]
