"""Clients that come every window in one lump (docs/fairness.md, late arrivals): a user
loading a page of requests every second at its own phase of the second, beside a batch job
that retries every 429. Max-min gives each user its whole page in every window (the pages
fit the level) and the batch job the rest; the users come back each window, so the light
reserve (booked one gap of two windows or more ahead) does not see them, and their rate,
taken as spread evenly over the window, predicted little of a page still to come: a page
late in the second found the cap spent by the batch job.

Scenarios are drawn at random (seeded): 2-6 users, each a page of its own size every
second at its own phase (0 to 0.97 of the second), asked within 10, 20 or 50 ms; a batch
job asking four times the cap and retrying each 429 three times; a cap of 100-400 a second
whose level holds every page. Each runs through ``fairlimit simulate``'s engine (on memory,
and two on Redis, which must admit the same) for 12 s and is measured against the exact
weighted max-min solver (tests/support/maxmin.py via fairness_figures.py) from the window
in which every user has come back once (its gap known: the 3rd; a page in the cap's first
window, where nobody has history yet, counts as its first). The bundled scenario
pages-every-second.yaml is one such case, its figures quoted in docs/fairness.md.
"""

import contextlib
import io
import json
import random
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import pytest

from fairlimit.cli import main
from fairlimit.store.base import Store
from fairness_cases import flat_config
from fairness_figures import Figures, page_user, retrying_batch, scenario_text, simulated
from helpers import once

pytestmark = pytest.mark.behaviour

ERROR = 0.10  # within 10% of its max-min share, one request of rounding allowed
SEEDS = range(16)
SECONDS = 12
SETTLED = 2  # windows before every user's gap is known (its first two pages)
BUNDLED = Path(__file__).resolve().parents[2] / "descriptors/scenarios/pages-every-second.yaml"


@dataclass(frozen=True)
class Drawn:
    scenario: str
    config: str


def draw(seed: int) -> Drawn:
    rng = random.Random(seed)
    capacity = rng.randint(100, 400)
    users = rng.randint(2, 6)
    # each page at most the level the pages leave the batch job (max-min gives it whole),
    # the pages together at most 0.8 of the cap
    most = min(capacity // (users + 1), int(0.8 * capacity / users))
    pages = [rng.randint(max(2, most // 4), most) for _ in range(users)]
    phases = sorted(round(rng.uniform(0.0, 0.97), 3) for _ in range(users))
    clients = [retrying_batch(capacity)]
    length = rng.choice([0.01, 0.02, 0.05])  # how long a page takes to ask
    for i, (page, phase) in enumerate(zip(pages, phases, strict=True)):
        clients.append(page_user(f"user{i}", phase, SECONDS, 1, page, length))
    scenario = scenario_text(f"lumps {seed}", SECONDS, 0.005, clients)
    return Drawn(scenario, flat_config(capacity, "second", capacity, active=users + 1))


async def _run(drawn: Drawn, where: Path, store: Callable[[], Store] | None = None) -> Figures:
    return await simulated(drawn.scenario, drawn.config, where, store)


@pytest.mark.asyncio
@pytest.mark.parametrize("seed", SEEDS)
async def test_a_page_every_window_gets_its_maxmin_share_at_any_phase(
    seed: int, tmp_path: Path
) -> None:
    """Every client, each user and the batch job, within ERROR of its max-min share of each
    window once every user's gap is known; the cap never passed."""
    drawn = draw(seed)
    got = await _run(drawn, tmp_path)
    worst = got.worst(got.windows[SETTLED:])
    assert worst.error <= ERROR, f"{worst}\n{drawn.scenario}{drawn.config}"
    assert max(w.over for w in got.windows) <= 1.0


@pytest.mark.asyncio
@pytest.mark.parametrize("seed", [6, 15])
@pytest.mark.parametrize("backend", ["redis"])
async def test_redis_admits_as_memory_does(seed: int, store: Store, tmp_path: Path) -> None:
    """On Redis (its script runs the same rule) every window admits what memory admits."""
    drawn = draw(seed)
    on_redis = await _run(drawn, tmp_path, once(store))
    on_memory = await _run(drawn, tmp_path)
    assert on_redis.admitted() == on_memory.admitted()


def test_the_bundled_scenario_admits_what_docs_fairness_quotes() -> None:
    """descriptors/scenarios/pages-every-second.yaml: five users, a page of 30 each second at
    0.13-0.93 of it, beside the batch job: from the 3rd second every user gets its 30 and the
    batch job 50 (max-min); the page at 0.93 gets 25 and 1 of its first two."""
    out, err = io.StringIO(), io.StringIO()
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
        code = main(["simulate", str(BUNDLED), "--format", "json"])
    assert (code, err.getvalue()) == (0, "")
    (fair,) = [c for c in json.loads(out.getvalue())["configs"] if c["label"] == "fairlimit"]
    each = {c["name"]: c["admitted_each_second"] for c in fair["clients"]}
    assert each["user5"][:2] == [25, 1]
    for name, seconds in each.items():
        assert set(seconds[SETTLED:]) == {50 if name == "batch" else 30}, name
