"""Shared fixtures: an injected clock, limiters over every backend, loaded configs."""

import os
import sys
import textwrap
from collections.abc import AsyncIterator, Callable
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "server"))

from fairlimit.config.loader import load  # noqa: E402
from fairlimit.core.rules import Loaded  # noqa: E402
from fairlimit.limiter import Limiter  # noqa: E402
from fairlimit.store.base import Store  # noqa: E402
from fairlimit.store.memory import MemoryStore  # noqa: E402

IN_CI = os.environ.get("CI", "").lower() == "true"

# Every backend the behaviour suite runs against. The Redis issue adds "redis" and
# "redis-cluster" here, with fixtures that start real redis-server processes.
BACKENDS = ["memory", "redis", "redis-cluster"]

# Real redis-server processes and the redis_store_factory / redis_cluster_store_factory
# fixtures the `store` fixture below asks for.
pytest_plugins = ["redis_servers"]


class FakeClock:
    """An injected clock: time moves only when a test moves it."""

    def __init__(self, start: float = 1_700_000_000.0) -> None:
        self.t = start

    def now(self) -> float:
        return self.t

    def advance(self, seconds: float) -> None:
        self.t += seconds


@pytest.fixture
def clock() -> FakeClock:
    return FakeClock()


def load_text(tmp_path: Path, text: str, name: str = "test.yaml") -> Loaded:
    """Load one descriptor file written from ``text`` (dedented)."""
    path = tmp_path / name
    path.write_text(textwrap.dedent(text))
    return load([path])


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


LimiterFactory = Callable[..., Limiter]


@pytest.fixture
def make_limiter(store: Store, clock: FakeClock, tmp_path: Path) -> Callable[..., Limiter]:
    """Build a limiter over the parametrized store from descriptor YAML text."""

    def make(text: str, **options: object) -> Limiter:
        return Limiter(load_text(tmp_path, text), store, clock, **options)  # type: ignore[arg-type]

    return make
