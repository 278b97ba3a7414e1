"""A cap's or shared bucket's verdict (core/validation.py works them out; a loaded config,
core/rules.py, holds them): its mode and the figures behind it."""

import enum
from dataclasses import dataclass


class Mode(enum.Enum):
    PER_CLIENT_BUCKETS = "per-client-buckets"
    WEIGHTED_FAIR_QUEUE = "weighted-fair-queue"
    GLOBAL_BUCKET_ONLY = "global-bucket-only"


@dataclass(frozen=True, slots=True)
class Classification:
    """One cap's (or shared bucket's) verdict, with the figures behind it."""

    source: str
    path: str
    mode: Mode
    message: str
    cap_per_second: float
    required_per_second: float | None = None
    per_client_per_second: float | None = None
    active_clients: int | None = None
    # which of the rule's limits a cap's verdict is about (a cap is classified once per
    # limit); None: the whole rule (a global bucket counts every limit it has)
    limit: int | None = None

    @property
    def is_warning(self) -> bool:
        """A contended cap: allowed, shared fairly; ``--strict`` refuses it."""
        return self.mode is Mode.WEIGHTED_FAIR_QUEUE

    @property
    def is_note(self) -> bool:
        """A global bucket: advice, never an error. It behaves as in envoyproxy/ratelimit,
        so a plain upstream config passes ``check --strict``."""
        return self.mode is Mode.GLOBAL_BUCKET_ONLY

    @property
    def line(self) -> str:
        """``FILE: PATH: message``, as every config message is printed."""
        return f"{self.source}: {self.path}: {self.message}"
