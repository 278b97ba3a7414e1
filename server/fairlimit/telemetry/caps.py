"""The per-cap fairness gauges, ``fairlimit.cap.*``: observable gauges that read the rows
``Telemetry.refresh`` last built (``telemetry.fairness``); attributes ``domain`` and
``rule``, never a client value. The ratios end in ``_ratio``, as Prometheus names unit-less
ratios."""

import math
from collections.abc import Callable, Iterable

from opentelemetry.metrics import CallbackOptions, Meter, Observation

from fairlimit.core.fairshare import FairnessFigures
from fairlimit.telemetry.fairness import CapRow

NO_LEVEL = -1.0  # fair_share_level when λ is infinite (uncontended)

_Reading = Callable[[CapRow], float | None]


def _figure(read: Callable[[FairnessFigures], float]) -> _Reading:
    return lambda row: None if row.figures is None else read(row.figures)


def _level(row: CapRow) -> float | None:
    if row.figures is None:
        return None
    level = row.figures.level
    # -1 while uncontended (λ infinite): the OpenTelemetry SDK drops non-finite values, and
    # a series that vanished under light load would look like a broken exporter.
    return NO_LEVEL if math.isinf(level) else level


def _over_declared(row: CapRow) -> float | None:
    return None if row.declared_clients is None else float(row.over_declared)


def _declared(row: CapRow) -> float | None:
    return None if row.declared_clients is None else float(row.declared_clients)


CAP_GAUGES: tuple[tuple[str, str, str, _Reading], ...] = (
    ("utilization_ratio", "1", "Admitted hits over the cap's capacity, last period",
     _figure(lambda f: f.utilization)),
    ("active_clients", "{client}", "Clients with demand at the cap, last period",
     _figure(lambda f: f.active_clients)),
    ("declared_clients", "{client}", "The cap's fair_share.active_clients", _declared),
    ("fair_share_level", "{hit}/s", "λ per unit weight; -1 when uncontended", _level),
    ("jain_index_ratio", "1", "Jain's index over admitted / max-min fair share",
     _figure(lambda f: f.jain_index)),
    ("top_client_share_ratio", "1", "The largest client's part of the admitted hits",
     _figure(lambda f: f.top_client_share)),
    ("starved_clients", "{client}", "Clients that got under 90% of their fair share",
     _figure(lambda f: f.starved_clients)),
    ("over_declared", "1", "1 when active clients exceed the declared active_clients",
     _over_declared),
)  # fmt: skip


class CapGauges:
    """The ``fairlimit.cap.*`` gauges, and the rows they read (``rows``, replaced whole)."""

    def __init__(self, meter: Meter) -> None:
        self.rows: tuple[CapRow, ...] = ()
        for name, unit, text, read in CAP_GAUGES:
            meter.create_observable_gauge(
                f"fairlimit.cap.{name}", [self._observer(read)], unit, text
            )
        meter.create_observable_gauge(
            "fairlimit.cap.mode", [self._modes], "1", "1 for the cap's classification (mode)"
        )

    def _observer(self, read: _Reading) -> Callable[[CallbackOptions], Iterable[Observation]]:
        def observe(options: CallbackOptions) -> Iterable[Observation]:
            out = []
            for row in self.rows:
                value = read(row)
                if value is not None:
                    out.append(Observation(value, {"domain": row.domain, "rule": row.rule}))
            return out

        return observe

    def _modes(self, options: CallbackOptions) -> Iterable[Observation]:
        return [
            Observation(1, {"domain": r.domain, "rule": r.rule, "mode": r.mode.value})
            for r in self.rows
        ]
