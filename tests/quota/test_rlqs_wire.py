"""The RLQS servicer's wire (grpc_api/rlqs.py ``Wire``) and the columns it trades with the
quota service (``Lines`` in, ``Assigns`` out): the same reports and responses as the plain
protobuf translation, whatever it keeps from one report to the next (issue 41)."""

import random
import tempfile
from pathlib import Path

import numpy as np
import pytest
from google.protobuf.message import DecodeError

from fairlimit._proto.envoy.service.rate_limit_quota.v3 import rlqs_pb2
from fairlimit.config.loader import load
from fairlimit.core.bucket import bucket_key
from fairlimit.core.quota import STEP, Blanket, TokenBucket
from fairlimit.core.request import MAX_TEXT
from fairlimit.core.rules import Loaded
from fairlimit.grpc_api.rlqs import Wire, response_to_proto, usages_from_proto
from fairlimit.quota import Abandon, Action, Assign, Assigns, Lines, QuotaService, Usage
from fairlimit.store.memory import MemoryStore
from helpers import FakeClock

pytestmark = [pytest.mark.behaviour]

Reports = rlqs_pb2.RateLimitQuotaUsageReports
Response = rlqs_pb2.RateLimitQuotaResponse

CONFIG = """
domain: edge
descriptors:
  - key: route
    value: public
    rate_limit: {unit: second, requests_per_unit: 100}
    fair_share: {active_clients: 2}
    descriptors:
      - key: client_id
        rate_limit: {unit: second, requests_per_unit: 50}
"""

BUCKETS = [
    {"route": "public", "client_id": "alice"},
    {"client_id": "bob", "route": "public"},
    {"route": "public", "client_id": "ß-ü-日本", "tier": "free"},
    {},
    {"route": "public", "client_id": "x" * 300},  # an action past 127 bytes
]


def loaded() -> Loaded:
    with tempfile.TemporaryDirectory() as tmp:
        path = Path(tmp) / "rlqs.yaml"
        path.write_text(CONFIG)
        return load([path])


def payload(lines: list[tuple[dict[str, str], int, int]], domain: str = "edge") -> bytes:
    message = Reports(domain=domain)
    for bucket, allowed, denied in lines:
        line = message.bucket_quota_usages.add()
        if bucket:
            line.bucket_id.bucket.update(bucket)
        line.num_requests_allowed, line.num_requests_denied = allowed, denied
        line.time_elapsed.seconds = 5
    return message.SerializeToString()


def wire() -> Wire:
    config = loaded()
    service = QuotaService(lambda: config, MemoryStore(), FakeClock().now)
    return Wire(service.open(lambda actions: None))


class TestReports:
    def test_a_report_reads_as_the_real_message_does(self) -> None:
        """Domain, buckets and counts (up to uint64's largest) as usages_from_proto has
        them, the first time and again from what was kept, each map the same object."""
        lines = [(b, i, 2**64 - 1 if i == 1 else 3 * i) for i, b in enumerate(BUCKETS)]
        data = payload(lines)
        expected = usages_from_proto(Reports.FromString(data))
        w = wire()
        domain, first = w.usages(data)
        assert domain == "edge" and list(first) == expected
        domain, again = w.usages(payload(lines[::-1]))
        assert list(again) == expected[::-1]
        assert all(a is b for a, b in zip(again.buckets, first.buckets[::-1], strict=True))

    def test_bytes_the_real_message_refuses_are_refused(self) -> None:
        """A bucket id or elapsed time that is no message is a DecodeError, as it is for
        RateLimitQuotaUsageReports (the stream then ends INVALID_ARGUMENT)."""
        bad_id = b"\x12\x05\x0a\x03\x0a\x01\xff"  # a line whose bucket id holds a torn entry
        bad_elapsed = b"\x12\x04\x12\x02\x08\xff"  # a line whose elapsed time is cut short
        for data in (bad_id, bad_elapsed):
            with pytest.raises(DecodeError):
                Reports.FromString(data)
            with pytest.raises(DecodeError):
                wire().usages(data)

    def test_what_is_kept_is_bounded(self) -> None:
        """Bucket maps of reports no subscription took are not kept past STEP and twice
        the stream's buckets (none here)."""
        w = wire()
        for start in range(0, 3 * STEP, 500):
            w.usages(payload([({"client_id": f"c{i}"}, 0, 1) for i in range(start, start + 500)]))
            assert len(w._maps) <= STEP + 500


class TestResponses:
    def actions(self, ttl: int) -> Assigns:
        strategies = [TokenBucket(10, 5, 1), Blanket.ALLOW_ALL, Blanket.DENY_ALL,
                      TokenBucket(2**32 - 1, 2**32 - 1, 1), TokenBucket(0, 0, 1)]  # fmt: skip
        return Assigns([Abandon({"client_id": "gone"})], BUCKETS, strategies, ttl)

    def test_a_response_encodes_as_response_to_proto(self) -> None:
        """Abandons first, then each bucket's assignment with its TTL: what response_to_proto
        builds, the first time, from what was kept, and after the TTL changes."""
        w = wire()
        for ttl in (15, 15, 30):
            actions = self.actions(ttl)
            assert Response.FromString(w.response(actions)) == response_to_proto(list(actions))

    def test_plain_actions_encode_as_before(self) -> None:
        """A list of actions (a provisional renewal) is response_to_proto's bytes."""
        actions: list[Action] = [Assign({"client_id": "a"}, Blanket.ALLOW_ALL, 9),
                                 Abandon({"client_id": "b"})]  # fmt: skip
        assert wire().response(actions) == response_to_proto(actions).SerializeToString()

    def test_a_long_value_is_answered_under_the_id_envoy_sent(self) -> None:
        """A bucket value past MAX_TEXT is divided under its stand-in, but Envoy knows the
        bucket by the id it sent: every response names that id, also once the kept ids were
        emptied (more than STEP since), when the others are encoded again from their maps."""
        long = {"route": "public", "client_id": "L" * 2000}
        w = wire()
        _, lines = w.usages(payload([(long, 1, 0)]))
        (bucket,) = lines.buckets
        assert bucket != long and len(bucket["client_id"]) <= MAX_TEXT  # its stand-in
        for _ in range(2):
            actions = Assigns([], [bucket], [Blanket.ALLOW_ALL], 9)
            (action,) = Response.FromString(w.response(actions)).bucket_action
            assert dict(action.bucket_id.bucket) == long
            others = [{"client_id": f"c{i}"} for i in range(STEP + 1)]  # fills the kept ids
            w.response(Assigns([], others, [Blanket.DENY_ALL] * len(others), 9))


class TestColumns:
    def test_assigns_read_as_a_sequence_of_actions(self) -> None:
        """The head, then an Assign per bucket: iterated, indexed from either end, sliced."""
        head: list[Action] = [Abandon({"client_id": "gone"})]
        a = Assigns(head, [{"client_id": "x"}, {"client_id": "y"}],
                    [Blanket.ALLOW_ALL, Blanket.DENY_ALL], 7)  # fmt: skip
        listed = [head[0], Assign({"client_id": "x"}, Blanket.ALLOW_ALL, 7),
                  Assign({"client_id": "y"}, Blanket.DENY_ALL, 7)]  # fmt: skip
        assert list(a) == listed and len(a) == 3
        assert [a[i] for i in range(-3, 3)] == listed * 2
        assert list(a[1:]) == listed[1:]
        with pytest.raises(IndexError):
            a[3]

    def test_lines_read_as_a_sequence_of_usages(self) -> None:
        counts = np.array([1, 2], dtype=np.uint64), np.array([3, 4], dtype=np.uint64)
        lines = Lines([{"client_id": "x"}, {"client_id": "y"}], *counts)
        assert list(lines) == [Usage({"client_id": "x"}, 1, 3), Usage({"client_id": "y"}, 2, 4)]
        assert list(lines[1:]) == [Usage({"client_id": "y"}, 2, 4)]
        with pytest.raises(ValueError, match="differ in length"):
            Lines([{}], np.array([1, 2], dtype=np.uint64), np.array([3], dtype=np.uint64))


@pytest.mark.asyncio
class TestOrder:
    async def test_a_report_in_a_new_order_counts_each_line_to_its_bucket(self) -> None:
        """The same maps listed in another order each report, with buckets abandoned in
        between (slots moved): every line's counts go to its own bucket (found by its map's
        identity, ``Holdings.by_map``)."""
        clock, config = FakeClock(), loaded()
        service = QuotaService(lambda: config, MemoryStore(), clock.now,
                               abandon_after=10)  # fmt: skip
        stream = service.open(lambda actions: None)
        maps = [{"route": "public", "client_id": f"c{i}"} for i in range(40)]
        busy = set(range(0, 40, 3))  # the others idle from the fourth report: abandoned
        totals = dict.fromkeys(range(40), 0)
        rng = random.Random(7)
        for round_ in range(10):
            clock.advance(4.0)
            listed = [i for i in range(40) if not round_ or bucket_key(maps[i]) in stream.buckets]
            rng.shuffle(listed)
            usages = [Usage(maps[i], 1, i + round_) if i in busy or round_ < 3
                      else Usage(maps[i], 0, 0) for i in listed]  # fmt: skip
            for u, i in zip(usages, listed, strict=True):
                totals[i] += u.denied
            await service.report(stream, "edge", usages)
        assert len(stream.buckets) == len(busy)
        for i in busy:
            assert stream.buckets[bucket_key(maps[i])].denied == totals[i]
