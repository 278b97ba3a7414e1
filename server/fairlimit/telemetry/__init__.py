"""What fairlimit tells monitoring: instruments, fairness figures per cap, the SDK wiring.

- ``instruments``: the ``Telemetry`` object the limiter records into, made through the
  OpenTelemetry API only, holding the instrument groups: ``rules`` (per-rule hit counters),
  ``calls`` (RPC latency, shed and refused calls, backend errors, config loads) and ``caps``
  (the per-cap fairness gauges).
- ``concurrency``: slots in flight, refused acquires and expired slots per pool rule.
- ``fairness``: one row of fairness figures per classified rule, folded from the store's cap
  reports and, for global buckets, measured on the request path (``/rlconfig`` reads them too).
- ``top``: each cap's top clients by demand and by rejections, in bounded memory, for the
  admin port only (``GET /top``): client values never become metric attributes.
- ``sdk``: the OpenTelemetry SDK (Prometheus registry, OTLP exporters), installed by the CLI
  and nowhere else; it is not imported here, so the rest never loads the SDK.
"""

from fairlimit.telemetry.instruments import Telemetry

__all__ = ["Telemetry"]
