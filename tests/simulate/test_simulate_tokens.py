"""`fairlimit simulate` with token budgets: descriptors/scenarios/token-reservations.yaml
runs 8 s LLM streams under check-then-charge and under reserve-then-settle; the first
overspends, the second never passes a limit and its counters end exact."""

import asyncio
from pathlib import Path

import pytest

from fairlimit.errors import ScenarioError
from fairlimit.simulate import load_scenario
from fairlimit.simulate.engine import run_async
from fairlimit.simulate.report import ConfigResult
from fairlimit.store.base import Store
from fairlimit.store.memory import MemoryStore

pytestmark = pytest.mark.unit

SCENARIO = Path(__file__).resolve().parents[2] / "descriptors" / "scenarios"
SCENARIO = SCENARIO / "token-reservations.yaml"


@pytest.fixture(scope="module")
def ran() -> tuple[list[ConfigResult], list[MemoryStore]]:
    stores: list[MemoryStore] = []

    def fresh() -> Store:
        stores.append(MemoryStore())
        return stores[-1]

    result = asyncio.run(run_async(load_scenario(SCENARIO), store=fresh))
    return list(result.configs), stores


def _levels(config: ConfigResult) -> dict[str, bool]:
    return {level.path: level.exceeded for level in config.levels}


def test_check_then_charge_overspends(ran: tuple[list[ConfigResult], list[MemoryStore]]) -> None:
    """Charges still to come let every check pass: the tenants and the cap overspend."""
    charged, _ = ran[0]
    assert charged.label == "charged-after"
    assert _levels(charged) == {"edge/provider=llm": True, "edge/provider=llm/tenant": True}


def test_reservations_never_pass_a_limit(
    ran: tuple[list[ConfigResult], list[MemoryStore]],
) -> None:
    reserved = ran[0][1]
    assert reserved.label == "reserved"
    assert _levels(reserved) == {"edge/provider=llm": False, "edge/provider=llm/tenant": False}


def test_the_counters_end_exact(ran: tuple[list[ConfigResult], list[MemoryStore]]) -> None:
    """Traffic stops at 170 s and every stream has ended by 178 s: in the last window the
    store's counter of each tenant, and the cap's, are the real tokens admitted in it."""
    reserved, store = ran[0][1], ran[1][1]
    last = reserved.windows[-1]
    assert (last.start, last.end) == (120.0, 180.0)
    counts = {key: c.count for key, c in store.counters.table.items()}
    names = [client.name for client in reserved.clients]
    for name, admitted in zip(names, last.admitted_by_client, strict=True):
        (key,) = [k for k in counts if f"tenant={name}" in k]
        assert counts[key] == admitted, name
    (cap,) = [k for k in counts if "tenant=" not in k]
    assert counts[cap] == last.admitted


def test_an_estimate_needs_charge_response(tmp_path: Path) -> None:
    text = SCENARIO.read_text().replace("estimate: 1500, charge: response", "estimate: 1500")
    path = tmp_path / "token-reservations.yaml"
    path.write_text(text)
    (tmp_path / "configs").symlink_to(SCENARIO.parent / "configs")
    with pytest.raises(ScenarioError) as caught:
        load_scenario(path)
    assert caught.value.problems == [
        f"{path}: clients[{i}].estimate: needs charge: response (the cost comes after)"
        for i in range(3)
    ]
