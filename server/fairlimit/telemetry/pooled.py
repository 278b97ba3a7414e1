"""One ``/metrics`` for ``--workers N``: every worker's series, each labelled ``worker``.

Worker 0 serves the admin HTTP; the others write their registry (Prometheus text) to a
directory the parent made, every DUMP_SECONDS and when they stop, and worker 0 reads those
files when scraped. Series are labelled, not summed, so that nothing is lost in a merge
(a gauge of one worker is no sum of all): ``sum without (worker)`` gives the totals.
"""

import os
from collections.abc import Iterable
from pathlib import Path

from prometheus_client import CollectorRegistry, generate_latest
from prometheus_client.metrics_core import Metric
from prometheus_client.parser import text_string_to_metric_families
from prometheus_client.registry import Collector

DIRECTORY_ENV = "FAIRLIMIT_WORKER_METRICS_DIR"  # set by the parent for its workers
DUMP_SECONDS = 1.0
_SUFFIX = ".prom"


def dump(registry: CollectorRegistry, directory: Path, worker: int) -> None:
    """Write ``worker``'s metrics where worker 0 reads them (replaced atomically)."""
    path = directory / f"worker-{worker}{_SUFFIX}"
    partial = directory / f".worker-{worker}.partial"
    partial.write_bytes(generate_latest(registry))
    os.replace(partial, path)


class WorkersCollector(Collector):
    """This worker's registry and the other workers' latest dumps, labelled by worker."""

    def __init__(self, own: CollectorRegistry, directory: Path, worker: int = 0) -> None:
        self._own = own
        self._directory = directory
        self._worker = str(worker)

    def collect(self) -> Iterable[Metric]:
        merged: dict[str, Metric] = {}
        _label(merged, self._own.collect(), self._worker)
        for path in sorted(self._directory.glob(f"worker-*{_SUFFIX}")):
            worker = path.name.removeprefix("worker-").removesuffix(_SUFFIX)
            if worker == self._worker:
                continue
            try:
                text = path.read_text()
            except OSError:  # a worker replacing its file: its previous dump is gone
                continue
            _label(merged, text_string_to_metric_families(text), worker)
        return list(merged.values())


def _label(merged: dict[str, Metric], families: Iterable[Metric], worker: str) -> None:
    for family in families:
        into = merged.get(family.name)
        if into is None:
            into = Metric(family.name, family.documentation, family.type, family.unit)
            merged[family.name] = into
        for sample in family.samples:
            into.samples.append(sample._replace(labels={**sample.labels, "worker": worker}))


def pooled_registry(own: CollectorRegistry, directory: Path, worker: int = 0) -> CollectorRegistry:
    """A registry rendering every worker's metrics (for worker 0's ``/metrics``)."""
    registry = CollectorRegistry(auto_describe=False)
    registry.register(WorkersCollector(own, directory, worker))
    return registry
