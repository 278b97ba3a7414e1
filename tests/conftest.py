"""Shared fixtures: an injected clock, a store and limiters over every backend.

Fixtures only (and the check that every test has a kind); shared helpers (FakeClock,
load_text, skip_or_fail, ...) live in helpers.py.
"""

import itertools
import sys
from collections.abc import AsyncIterator, Callable
from pathlib import Path

import pytest
from hypothesis import HealthCheck, Phase, settings

# Property tests check behaviour, not speed: on a loaded 2-core machine (CI, or several
# suites at once) an example may take longer than Hypothesis' 200 ms deadline or its
# input-generation budget; neither is a failure of the code under test.
settings.register_profile("fairlimit", deadline=None, suppress_health_check=[HealthCheck.too_slow])
settings.load_profile("fairlimit")

# tests/mutate.sh runs the suite once per mutant inside one process, so each property is
# called from several runs (differing executors); derandomized, so that a mutant is killed
# or not the same way every time; a quarter of the examples, as it runs thousands of times;
# no shrinking: a mutant is killed by the first failing example, and shrinking it to the
# smallest took up to 50 s a mutant for a verdict that was already in.
settings.register_profile(
    "mutation",
    parent=settings.get_profile("fairlimit"),
    max_examples=25,
    phases=[Phase.explicit, Phase.generate],
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.differing_executors],
    derandomize=True,
    database=None,
)

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "server"))
# helpers, servers, the exact solver...: the modules the tests share (tests/support/)
sys.path.insert(0, str(ROOT / "tests" / "support"))

from fairlimit.limiter import Limiter  # noqa: E402
from fairlimit.store.base import Store  # noqa: E402
from fairlimit.store.memory import MemoryStore  # noqa: E402
from helpers import FakeClock, load_text  # noqa: E402

# Every backend the behaviour suite runs against: memory, and real redis-server processes
# (standalone and a three-master cluster).
BACKENDS = ["memory", "redis", "redis-cluster"]

# Real redis-server processes and the redis_store_factory / redis_cluster_store_factory
# fixtures the `store` fixture below asks for.
pytest_plugins = ["redis_servers"]


@pytest.fixture
def clock() -> FakeClock:
    return FakeClock()


@pytest.fixture(params=BACKENDS)
def backend(request: pytest.FixtureRequest) -> str:
    return str(request.param)


@pytest.fixture
async def store(backend: str, request: pytest.FixtureRequest) -> AsyncIterator[Store]:
    """A fresh, empty store of the parametrized backend."""
    if backend == "memory":
        made: Store = MemoryStore()
    else:
        factory = request.getfixturevalue(f"{backend.replace('-', '_')}_store_factory")
        made = await factory()
    yield made
    await made.close()


_prefixes = itertools.count()


@pytest.fixture
def open_store(backend: str, request: pytest.FixtureRequest) -> Callable[[], Store]:
    """Opens a store of ``backend`` per example (property tests: one store per Hypothesis
    example); on Redis a fresh key prefix on the test's server, not a new server."""
    if backend == "memory":
        return MemoryStore
    from fairlimit.store.redis import open_redis
    from redis_servers import suite_url

    server = request.getfixturevalue("redis_server" if backend == "redis" else "redis_cluster")
    return lambda: open_redis(suite_url(server.url, key_prefix=f"ex{next(_prefixes)}:"))


@pytest.fixture
def make_limiter(store: Store, clock: FakeClock, tmp_path: Path) -> Callable[..., Limiter]:
    """Build a limiter over the parametrized store from descriptor YAML text."""

    def make(text: str, **options: object) -> Limiter:
        return Limiter(load_text(tmp_path, text), store, clock, **options)  # type: ignore[arg-type]

    return make


KINDS = ("unit", "behaviour", "process")  # pyproject's markers: `-m unit` and so on
# The folders under tests/, one per package of server/fairlimit (and e2e, deploy): each test
# is also marked with its folder, so `-m quota` runs the tests of quota/ and nothing else.
PACKAGES = ("admin", "app", "config", "core", "deploy", "e2e", "grpc_api", "limiter", "policy",
            "quota", "settings", "simulate", "store", "telemetry")  # fmt: skip
TESTS = Path(__file__).resolve().parent


def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    """Every test is of one kind and lives in one package's folder, or `-m unit` (and the
    others) would quietly skip it; the folder becomes a marker too."""
    unmarked, astray = set(), set()
    for item in items:
        if not any(item.get_closest_marker(kind) for kind in KINDS):
            unmarked.add(item.nodeid.split("::")[0])
        folder = Path(item.path).resolve().relative_to(TESTS).parts[0]
        if folder in PACKAGES:
            item.add_marker(folder)
        else:
            astray.add(item.nodeid.split("::")[0])
    if unmarked:
        raise pytest.UsageError("tests without a kind marker (unit, behaviour or process): "
                                + ", ".join(sorted(unmarked)))  # fmt: skip
    if astray:
        raise pytest.UsageError("tests outside a package folder of tests/ (" + ", ".join(PACKAGES)
                                + "): " + ", ".join(sorted(astray)))  # fmt: skip
