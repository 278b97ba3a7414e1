"""The RLQS gauges' figures (telemetry/quota.py): worked out from the state the quota
service publishes, at most once a FIGURES_SECONDS unless the state changed at once."""

import pytest

from fairlimit.core.quota import Blanket, TokenBucket
from fairlimit.telemetry.quota import FIGURES_SECONDS, QuotaFigures, QuotaTelemetry, figures_of

pytestmark = pytest.mark.unit

TEN = TokenBucket(max_tokens=10, tokens_per_fill=100, fill_seconds=10)  # 10/s
FIVE = TokenBucket(max_tokens=5, tokens_per_fill=50, fill_seconds=10)  # 5/s


class TestFigures:
    def test_rates_and_headroom_sum_per_domain_over_token_buckets(self) -> None:
        """Subscriptions count per domain (a stream with none too); a blanket rule or no
        assignment yet adds no rate and no headroom."""
        streams = [
            ("edge", [(TEN, 2.0), (Blanket.ALLOW_ALL, 7.0)]),
            ("edge", [(FIVE, 0.5), (None, 3.0)]),
            ("api", []),
        ]
        assert figures_of(streams) == QuotaFigures(
            3, {"edge": 4, "api": 0}, {"edge": 15.0}, {"edge": 2.5}
        )

    def test_no_stream_no_figures(self) -> None:
        assert figures_of([]) == QuotaFigures()


class TestPublishing:
    def test_read_at_most_once_a_second_unless_stale(self) -> None:
        """Reads within FIGURES_SECONDS reuse the figures; ``stale`` or the time passing
        works them out again from the source."""
        now = [100.0]
        state: list[tuple[str, list[tuple[TokenBucket | None, float]]]] = [("edge", [(TEN, 0)])]
        reads = []

        def source() -> list[tuple[str, list[tuple[TokenBucket | None, float]]]]:
            reads.append(now[0])
            return list(state)

        telemetry = QuotaTelemetry.off()
        assert telemetry.figures == QuotaFigures()  # nothing published: none
        telemetry.publish(source, lambda: now[0])
        assert telemetry.figures.streams == 1
        state.append(("edge", []))
        now[0] += FIGURES_SECONDS / 2
        assert telemetry.figures.streams == 1 and len(reads) == 1
        telemetry.stale()
        assert telemetry.figures.streams == 2 and len(reads) == 2
        state.pop()
        now[0] += FIGURES_SECONDS
        assert telemetry.figures.streams == 1 and len(reads) == 3
