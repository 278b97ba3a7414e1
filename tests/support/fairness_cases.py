"""The fairness scenarios of issue 11 (its table, plus steady per-second and per-minute caps).

Each is small enough to run in a second or two on memory; the numbers in the names are the
issue's: a cap of 6000/min shared by ten steady clients and a burst, and so on.
"""

from fairness_scenarios import INF, Cap, Client, Phase, Scenario


def flat_config(
    capacity: int, unit: str, client_limit: int, active: int = 10, client_unit: str = ""
) -> str:
    """One fair-share cap over its clients' own limits (per ``client_unit``, else ``unit``)."""
    client_unit = client_unit or unit
    return f"""
domain: fair
descriptors:
  - key: route
    value: api
    rate_limit: {{unit: {unit}, requests_per_unit: {capacity}}}
    fair_share: {{active_clients: {active}}}
    descriptors:
      - key: client_id
        rate_limit: {{unit: {client_unit}, requests_per_unit: {client_limit}}}
"""


NESTED = """
domain: fair
descriptors:
  - key: route
    value: api
    rate_limit: {unit: second, requests_per_unit: 1000}
    fair_share: {active_clients: 2}
    descriptors:
      - key: tenant
        rate_limit: {unit: second, requests_per_unit: 600}
        fair_share: {active_clients: 3}
        descriptors:
          - key: user
            rate_limit: {unit: second, requests_per_unit: 200}
"""


def client(name: str, *phases: Phase, cost: int = 1) -> Client:
    return Client(name, (name,), ("route=api", f"client_id={name}"), phases, cost)


def user(tenant: str, name: str, *phases: Phase) -> Client:
    entries = ("route=api", f"tenant={tenant}", f"user={name}")
    return Client(name, (tenant, name), entries, phases)


def steady(n: int, prefix: str, rate: float, start: float, stop: float) -> list[Client]:
    return [client(f"{prefix}{i}", Phase(start, stop, rate)) for i in range(n)]


MINUTE = 60

BURST_AT_ZERO = Scenario(
    "burst at second 0 (6000/min)",
    flat_config(6000, "minute", 6000),
    "fair",
    Cap(6000, MINUTE, 6000),
    (*steady(10, "s", 10, 0, 180), client("burst", Phase(60, 180, 100, burst=3001))),
    180,
)

LATE_GREEDY = Scenario(
    "greedy arrives late (6000/min)",
    flat_config(6000, "minute", 6000),
    "fair",
    Cap(6000, MINUTE, 6000),
    (*steady(5, "sparse", 0.2, 0, 120), client("greedy", Phase(110, 120, 1000))),
    120,
)

BURST_AFTER_IDLE = Scenario(
    "burst after an idle second (600/min)",
    flat_config(600, "minute", 600),
    "fair",
    Cap(600, MINUTE, 600),
    (*steady(5, "sparse", 0.2, 0, 180), client("burst", Phase(61, 180, 20, burst=600))),
    180,
)

NESTED_CAPS = Scenario(
    "nested 1000/s > 600/s > 200/s",
    NESTED,
    "fair",
    Cap(1000, 1, 600, nested={"A": Cap(600, 1, 200), "B": Cap(600, 1, 200)}),
    tuple(user("A", f"a{i}", Phase(0, 6, 300)) for i in range(5))
    + tuple(user("B", f"b{i}", Phase(0, 6, 150)) for i in range(3)),
    6,
)

ON_OFF = Scenario(
    "on/off client (100/s)",
    flat_config(100, "second", 100),
    "fair",
    Cap(100, 1, 100),
    (*steady(4, "s", 50, 0, 10), client("onoff", Phase(0, 10, 200, every=2, on=0.2))),
    10,
)

JOIN_LEAVE = Scenario(
    "a client joins, one leaves (100/s)",
    flat_config(100, "second", 100),
    "fair",
    Cap(100, 1, 100),
    (
        client("leaver", Phase(0, 7, 50)),
        *steady(3, "s", 50, 0, 10),
        client("joiner", Phase(4, 10, 50)),
    ),
    10,
)

FRACTIONAL = Scenario(
    "fractional λ (1000/s, 7 clients)",
    flat_config(1000, "second", 1000),
    "fair",
    Cap(1000, 1, 1000),
    tuple(steady(7, "s", 300, 0, 5)),
    5,
)

STEADY_SECOND = Scenario(
    "steady per second (100/s)",
    flat_config(100, "second", 30),
    "fair",
    Cap(100, 1, 30),
    (*steady(5, "big", 50, 0, 5), *steady(4, "small", 5, 0, 5)),
    5,
)

STEADY_MINUTE = Scenario(
    "steady per minute (6000/min)",
    flat_config(6000, "minute", 1800),
    "fair",
    Cap(6000, MINUTE, 1800),
    (*steady(5, "big", 50, 0, 180), *steady(4, "small", 5, 0, 180)),
    180,
)

TOKENS = Scenario(
    "token budget 60000/min, 4 tenants",
    flat_config(60000, "minute", 30000, active=4),
    "fair",
    Cap(60000, MINUTE, 30000),
    (
        client("big", Phase(0, 180, 4), cost=500),
        client("mid", Phase(0, 180, 1), cost=400),
        client("small", Phase(0, 180, 0.5), cost=300),
        client("late", Phase(70, 180, 3), cost=600),
    ),
    180,
)

# Not in SCENARIOS (their figures are per whole window): the first 230 s of an hour. ``a``
# asks for twice its share (1/2 hit a second) for two minutes, is silent for 80 s (past the
# 64 periods after which its demand history is gone) and comes back; its admissions earlier
# in the hour still count against its share of the elapsed hour.
SILENT_IN_HOUR = Scenario(
    "a client silent for 80 s within an hour (3600/h)",
    flat_config(3600, "hour", 3600, active=2),
    "fair",
    Cap(3600, 3600, 3600),
    (
        client("a", Phase(0, 120, 2), Phase(200, 230, 10)),
        client("b", Phase(0, 230, 2)),
    ),
    230,
)

SCENARIOS = (
    BURST_AT_ZERO,
    LATE_GREEDY,
    BURST_AFTER_IDLE,
    NESTED_CAPS,
    ON_OFF,
    JOIN_LEAVE,
    FRACTIONAL,
    STEADY_SECOND,
    STEADY_MINUTE,
    TOKENS,
)

__all__ = ["INF", "SCENARIOS"]
