"""core/admission.py ``moved``: a kept plan's statuses worked out from its last ones when
only its counts moved, each level by the same hits (a hot payload's next request), are the
statuses worked out whole; when they might not be, ``moved`` says None."""

import math
import random
from pathlib import Path

import pytest

from config_fuzz import draw_accepted, draw_request
from fairlimit.core.admission import Outcome, moved, statuses
from fairlimit.core.plan import Plan
from fairlimit.core.plan import plan as make_plan
from fairlimit.core.request import validate
from fairlimit.errors import RequestError
from fairlimit.flows.decision import active
from fairlimit.grpc_api import lenient
from fairlimit.grpc_api.convert import request_from_proto

pytestmark = pytest.mark.unit

BASE = 1_700_000_000.0


def _plans(rng: random.Random, folder: Path, configs: int) -> list[Plan]:
    """Plans of requests drawn for configs ``check`` accepts (tests/support/config_fuzz)."""
    out = []
    for _ in range(configs):
        config, loaded = draw_accepted(rng, folder / "c.yaml")
        matcher = active(loaded).matcher
        for _ in range(6):
            payload = draw_request(rng, config).SerializeToString()
            try:
                request = request_from_proto(lenient.request(payload))
                validate(request)
            except RequestError:
                continue
            built = make_plan(request, matcher)
            if built.counters:
                out.append(built)
    return out


def _outcome(rng: random.Random, built: Plan) -> Outcome:
    """Counts around each counter's limit, claims and bounds around each other."""
    counts = tuple(rng.choice([0, 1, c.limit - 3, c.limit - 1, rng.randint(0, max(1, c.limit))])
                   for c in built.counters)  # fmt: skip
    shared = tuple(rng.randint(0, 40) for _ in built.shares)
    # a bound may leave the client less room than its own limit does: the level reported
    bounds = tuple(rng.choice([math.inf, float(rng.randint(0, 60)), n + rng.uniform(1, 30)])
                   for n in shared)  # fmt: skip
    full_at = tuple(BASE + rng.uniform(0, 200) for _ in built.counters)  # sliding, GCRA
    return Outcome(rng.random() < 0.9, counts, shared, bounds, None, full_at)


def _later(rng: random.Random, before: Outcome) -> Outcome:
    """``before`` with every level moved by the same hits, or now and then not quite."""
    d = rng.choice([0, 1, 1, 2, 5])
    counts = [n + d for n in before.counts]
    shared = [n + d for n in before.shared]
    bounds = list(before.bounds)
    spoil = rng.random()  # now and then one level moved by a hit more, or a bound
    if spoil < 0.3:
        kinds = [k for k, levels in (("c", counts), ("s", shared)) if levels]
        kind = rng.choice([*kinds, "b"] if bounds else kinds)
        if kind == "c":
            counts[rng.randrange(len(counts))] += 1  # another request charged it
        elif kind == "s":
            shared[rng.randrange(len(shared))] += 1
        else:
            bounds[rng.randrange(len(bounds))] += 1.0  # the division moved the bound
    admitted = before.admitted if rng.random() < 0.95 else not before.admitted
    return Outcome(admitted, tuple(counts), tuple(shared), tuple(bounds), None, before.full_at)


@pytest.mark.parametrize("seed", range(4))
def test_moved_statuses_are_those_worked_out_whole(seed: int, tmp_path: Path) -> None:
    rng = random.Random(seed)
    plans = _plans(rng, tmp_path, 40)
    assert plans
    taken = 0
    for built in plans:
        for _ in range(30):
            before = _outcome(rng, built)
            then = BASE + rng.uniform(0, 100)
            said = statuses(built, before, then)
            # later in the same second mostly, in another now and then
            now = then + rng.choice([0.0, (math.floor(then) + 1 - then) * rng.random(), 1.0])
            later = _later(rng, before)
            got = moved(built, before, then, said, later, now)
            if got is not None:
                taken += 1
                assert got == statuses(built, later, now), (built, before, later, then, now)
    assert taken > 100  # the rule was exercised, not only refused
