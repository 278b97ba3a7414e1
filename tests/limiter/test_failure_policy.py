"""One failure behaviour for every flow (policy/guarded.py): the rates, slots and tokens flows
call the store through the failure policy, so a store that is down gives each of them the
failure mode's answer - UNAVAILABLE under closed, OK under open, this process's part of the
limit under local - and none of them decides by itself what a failure means."""

from collections.abc import Callable, Mapping, Sequence
from pathlib import Path

import pytest

from fairlimit.core.admission import Code, Outcome
from fairlimit.core.concurrency import Claim, SlotOutcome
from fairlimit.core.fairshare import CapReport
from fairlimit.core.plan import Plan
from fairlimit.core.request import Descriptor, Request
from fairlimit.core.reserve import Settle, Settled, Usage
from fairlimit.errors import StoreUnavailable
from fairlimit.limiter import Limiter
from fairlimit.settings import FailureMode
from fairlimit.store.replicas import Replicas
from helpers import FakeClock, desc, load_text, req

pytestmark = pytest.mark.behaviour

CONFIG = """
domain: edge
descriptors:
  - key: client_id
    rate_limit: {unit: hour, requests_per_unit: 4}
  - key: job
    concurrency: {max_in_flight: 4, max_duration: 30}
  - key: model
    rate_limit: {unit: hour, requests_per_unit: 4}
    reservation: {default: 1, max_duration: 120}
"""

# the nth request of each flow: each its own request id, none given back
KINDS: dict[str, Callable[[int], Request]] = {
    "rates": lambda n: req("edge", desc("client_id=x")),
    "slots": lambda n: req("edge", desc("job=j", f"request_id=s{n}")),
    "tokens": lambda n: req("edge", desc("model=m", f"request_id=t{n}")),
}


class Down:
    """A backend that is gone: every call fails as a refused connection does."""

    async def admit(self, plan: Plan, now: float) -> Outcome:
        raise StoreUnavailable("redis: connection refused")

    async def acquire(self, claims: Sequence[Claim], now: float) -> SlotOutcome:
        raise StoreUnavailable("redis: connection refused")

    async def release(self, claims: Sequence[Claim], now: float) -> tuple[bool, ...]:
        raise StoreUnavailable("redis: connection refused")

    async def settle(self, plan: Plan, settle: Settle, now: float) -> Settled:
        raise StoreUnavailable("redis: connection refused")

    async def usage(self, plan: Plan, now: float) -> Usage:
        raise StoreUnavailable("redis: connection refused")

    async def exchange_demand(
        self, consumer: str, report: str, now: float, ttl: float
    ) -> Mapping[str, str]:
        raise StoreUnavailable("redis: connection refused")

    async def caps(self) -> Mapping[str, CapReport]:
        raise StoreUnavailable("redis: connection refused")

    async def ping(self) -> None:
        raise StoreUnavailable("redis: connection refused")

    async def close(self) -> None:
        return None


def _limiter(tmp_path: Path, clock: FakeClock, mode: FailureMode) -> Limiter:
    replicas = Replicas()
    replicas.saw("a", ["b"])  # two processes share the store: this one's part is half
    return Limiter(load_text(tmp_path, CONFIG), Down(), clock, failure_mode=mode,
                   replicas=replicas)  # fmt: skip


async def _codes(limiter: Limiter, kind: str, times: int) -> list[Code]:
    make = KINDS[kind]
    return [(await limiter.should_rate_limit(make(n))).code for n in range(times)]


@pytest.mark.parametrize("kind", sorted(KINDS))
class TestEveryFlowTheSameFailureMode:
    async def test_closed_answers_unavailable(
        self, kind: str, tmp_path: Path, clock: FakeClock
    ) -> None:
        """closed: the request is not decided; StoreUnavailable (UNAVAILABLE on the wire)."""
        limiter = _limiter(tmp_path, clock, FailureMode.CLOSED)
        with pytest.raises(StoreUnavailable):
            await limiter.should_rate_limit(KINDS[kind](0))
        assert not limiter.backend_healthy

    async def test_open_lets_every_request_through(
        self, kind: str, tmp_path: Path, clock: FakeClock
    ) -> None:
        """open: OK, past the limit too (4 an hour, 4 in flight: 6 asked)."""
        limiter = _limiter(tmp_path, clock, FailureMode.OPEN)
        assert await _codes(limiter, kind, 6) == [Code.OK] * 6
        assert not limiter.backend_healthy

    async def test_local_admits_this_process_part(
        self, kind: str, tmp_path: Path, clock: FakeClock
    ) -> None:
        """local over 2 processes: 2 of the 4 here, then OVER_LIMIT, whatever the flow."""
        limiter = _limiter(tmp_path, clock, FailureMode.LOCAL)
        assert await _codes(limiter, kind, 4) == [Code.OK] * 2 + [Code.OVER_LIMIT] * 2
        assert limiter.local is not None and limiter.local.active


def _done(n: int, real: int) -> Request:
    """The stream-done call of the nth tokens request: its real cost."""
    entries = (("model", "m"), ("request_done", f"t{n}"))
    return Request("edge", (Descriptor(entries, None, real),))


class TestASettlementTheStoreCannotTake:
    @pytest.mark.parametrize("mode", [FailureMode.OPEN, FailureMode.LOCAL])
    async def test_leaves_the_reservation_as_charged(
        self, mode: FailureMode, tmp_path: Path, clock: FakeClock
    ) -> None:
        """open and local answer the stream-done call OK and give nothing back: under local
        the part of 2 stays spent."""
        limiter = _limiter(tmp_path, clock, mode)
        assert await _codes(limiter, "tokens", 2) == [Code.OK] * 2
        assert (await limiter.should_rate_limit(_done(0, 0))).code is Code.OK
        after = (await limiter.should_rate_limit(KINDS["tokens"](2))).code
        assert after is (Code.OK if mode is FailureMode.OPEN else Code.OVER_LIMIT)

    async def test_closed_answers_unavailable(self, tmp_path: Path, clock: FakeClock) -> None:
        """closed: the stream-done call is not decided either."""
        limiter = _limiter(tmp_path, clock, FailureMode.CLOSED)
        with pytest.raises(StoreUnavailable):
            await limiter.should_rate_limit(_done(0, 0))
