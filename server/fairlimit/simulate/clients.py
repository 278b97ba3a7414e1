"""Client entries of a scenario file: traffic, cost, tenant, how it is charged.

A client entry is one client, or ``count`` identical ones (``name-1`` ... ``name-N``, drawn
as one band by ``plot``). Its traffic is ``rate``/``start``/``stop`` or a list of ``phases``
(``traffic.Phase``; ``every: 2, for: 0.2`` is an on/off cycle); ``cost`` is hits per
request (``traffic.Cost``); ``tenant`` fills the ``{tenant}`` placeholder of the request
template, as ``{client}`` takes its name; ``charge: response`` sends the request as Envoy's
two-phase flow does for token budgets: a check with ``hits_addend: 0`` first, then, once
admitted, the cost as a charge (when the stream ends: ``request_duration`` later). Under a
config whose rule declares a ``reservation`` such a client reserves ``estimate`` (its
``hits_addend``; unset: the rule's default) by request id instead, and the stream-done call
settles that id with the cost (docs/tokens.md).
"""

import math
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from fairlimit.simulate.reader import ABOVE_ZERO, Reader, Rule, after, within
from fairlimit.simulate.traffic import Cost, Phase

MAX_RETRIES = 1_000_000
MAX_OFFERED = 10_000_000  # original requests per run: beyond, a run takes minutes
MAX_COUNT = 10_000  # identical clients per entry
MAX_COST = 1_000_000_000  # hits per request: Envoy's own bound on hits_addend
CLIENT_KEYS = frozenset(
    {"name", "rate", "retries", "weight", "start", "stop", "request_duration"}
    | {"phases", "cost", "count", "tenant", "group", "charge", "estimate"}
)
# "for", not "on": YAML 1.1 reads a key `on` as the boolean true.
PHASE_KEYS = frozenset({"start", "stop", "rate", "every", "for", "burst"})
CHARGES = ("request", "response")
ONE_HIT = Cost()


@dataclass(frozen=True, slots=True)
class Retries:
    """A rejected request is sent again after ``backoff`` seconds, at most ``max`` times."""

    max: int = 0
    backoff: float = 0.0


@dataclass(frozen=True, slots=True)
class Client:
    name: str
    phases: tuple[Phase, ...]
    retries: Retries
    weight: float  # informational: the config's fair_share.weights decide
    cost: Cost = ONE_HIT
    tenant: str = ""
    group: str = ""  # the entry's name when it made ``count`` clients, else the client's
    charge_after: bool = False  # ``charge: response``: check with 0 hits, then charge
    # seconds an admitted request stays in flight (0: not modelled); with it, every request
    # carries a request id and its stream-done release follows, so concurrency caps apply
    request_duration: float = 0.0
    estimate: int = 0  # ``charge: response`` under a reservation: hits reserved (0: none)

    @property
    def active(self) -> float:
        """Seconds the client sends at its rates (bursts take no time)."""
        return sum(p.active for p in self.phases)


def _retries(reader: Reader, raw: object, path: str) -> Retries:
    node = reader.mapping(raw, path, frozenset({"max", "backoff"}))
    if node is None:
        return Retries()
    count = node.get("max", 0)
    if isinstance(count, bool) or not isinstance(count, int) or not 0 <= count <= MAX_RETRIES:
        reader.add(f"{path}.max", f"must be an integer from 0 to {MAX_RETRIES}, not {count!r}")
        count = 0
    backoff = reader.number(node, "backoff", f"{path}.backoff", within(0, 3600), 0.0)
    return Retries(count, backoff or 0.0)


def _phase(reader: Reader, raw: object, where: str, duration: float) -> Phase | None:
    if isinstance(raw, dict) and (spelt := {k for k in raw if k is True or k == "on"}):
        # `on: 0.2` unquoted is the key True in YAML 1.1: name the fix, read it as `for`
        reader.add(where, "write 'for' for the seconds on (YAML reads a key 'on' as true)")
        raw = {("for" if k in spelt else k): v for k, v in raw.items()}
    node = reader.mapping(raw, where, PHASE_KEYS)
    if node is None:
        return None

    def number(key: str, rule: Rule, default: float | None) -> float:
        return reader.number(node, key, f"{where}.{key}", rule, default) or 0.0

    start = number("start", within(0, duration), 0.0)
    stop = number("stop", after(start, duration, "start"), duration) or duration
    rate = number("rate", within(0, 1e7), 0.0)
    every = number("every", ABOVE_ZERO, 0.0)
    on = number("for", within(0, every, "seconds on, a number"), 0.0) if every else 0.0
    if every and not on:
        reader.add(f"{where}.for", "must be above 0 when 'every' is given")
    burst = reader.integer(node, "burst", f"{where}.burst", MAX_OFFERED)
    if not rate and not burst:
        reader.add(where, "sends nothing: give a rate above 0 or a burst")
    return Phase(start, stop, rate, every, on, burst)


def _phases(
    reader: Reader, node: Mapping[str, Any], where: str, duration: float
) -> tuple[Phase, ...]:
    if "phases" not in node:
        rate = reader.number(node, "rate", f"{where}.rate", ABOVE_ZERO, None) or 1.0
        start = reader.number(node, "start", f"{where}.start", within(0, duration), 0.0) or 0.0
        rule = after(start, duration, "start")
        stop = reader.number(node, "stop", f"{where}.stop", rule, duration) or duration
        return (Phase(start, stop, rate),)
    if any(k in node for k in ("rate", "start", "stop")):
        reader.add(where, "give 'rate', 'start' and 'stop' or 'phases', not both")
    raw = node["phases"]
    if not isinstance(raw, list) or not raw:
        reader.add(f"{where}.phases", "must be a non-empty list of phases")
        return ()
    phases = [_phase(reader, p, f"{where}.phases[{i}]", duration) for i, p in enumerate(raw)]
    return tuple(p for p in phases if p is not None)


WHOLE_COST: Rule = (
    f"an integer from 1 to {MAX_COST}",
    lambda x: x == int(x) and 1 <= x <= MAX_COST,
)
COST_FORMS = "give a number, {uniform: [low, high]} or {values: [...], weights: [...]}"


def _costs(reader: Reader, raw: object, where: str, two: bool) -> tuple[int, ...]:
    """A list of whole costs (exactly two when ``two``); () after reporting a problem."""
    if not isinstance(raw, list) or not raw or (two and len(raw) != 2):
        reader.add(where, "must be [low, high]" if two else "must be a non-empty list of integers")
        return ()
    numbers = [reader.number({"v": v}, "v", where, WHOLE_COST, None) for v in raw]
    return () if None in numbers else tuple(int(n or 0) for n in numbers)


def _weights(reader: Reader, raw: object, where: str, n: int) -> tuple[float, ...]:
    numbers = raw if isinstance(raw, list) and len(raw) == n else []
    if not numbers or not all(
        isinstance(w, int | float) and not isinstance(w, bool) and w > 0 for w in numbers
    ):
        reader.add(where, f"must be {n} numbers above 0, one per value")
        return ()
    return tuple(float(w) for w in numbers)


def _cost(reader: Reader, raw: object, where: str) -> Cost:
    if not isinstance(raw, dict):
        value = reader.number({"cost": raw}, "cost", where, WHOLE_COST, None)
        return Cost((int(value),)) if value else ONE_HIT
    node = reader.mapping(raw, where, frozenset({"uniform", "values", "weights"}))
    if node is None or ("uniform" in node) == ("values" in node):
        reader.add(where, COST_FORMS)
        return ONE_HIT
    if "uniform" in node:
        bounds = _costs(reader, node["uniform"], f"{where}.uniform", two=True)
        if bounds and bounds[0] > bounds[1]:
            reader.add(f"{where}.uniform", f"must go from low to high, not {list(bounds)}")
        return Cost(uniform=(bounds[0], bounds[1])) if bounds else ONE_HIT
    values = _costs(reader, node["values"], f"{where}.values", two=False)
    if not values:
        return ONE_HIT
    weights = _weights(
        reader, node.get("weights", [1] * len(values)), f"{where}.weights", len(values)
    )
    return Cost(values, weights) if weights else ONE_HIT


def _entry(reader: Reader, node: Mapping[str, Any], where: str, duration: float) -> list[Client]:
    """The clients of one entry: one, or ``count`` alike."""
    name = reader.text(node, "name", f"{where}.name")
    retries = (
        _retries(reader, node["retries"], f"{where}.retries") if "retries" in node else Retries()
    )
    weight = reader.number(node, "weight", f"{where}.weight", ABOVE_ZERO, 1.0) or 1.0
    phases = _phases(reader, node, where, duration)
    cost = _cost(reader, node["cost"], f"{where}.cost") if "cost" in node else ONE_HIT
    if retries.max and cost.fixed is None:
        reader.add(f"{where}.retries", "a client whose cost varies cannot retry")
    tenant = reader.text(node, "tenant", f"{where}.tenant") if "tenant" in node else ""
    group = reader.text(node, "group", f"{where}.group") if "group" in node else ""
    charge = node.get("charge", "request")
    if charge not in CHARGES:
        reader.add(f"{where}.charge", f"must be one of request, response, not {charge!r}")
    count = reader.integer(node, "count", f"{where}.count", MAX_COUNT) if "count" in node else 1
    if not count:
        reader.add(f"{where}.count", "must be at least 1")
    names = [name] if count == 1 else [f"{name}-{i}" for i in range(1, count + 1)]
    group = group or name
    after = charge == "response"
    held = reader.number(
        node, "request_duration", f"{where}.request_duration", within(0, 86400), 0.0
    )
    estimate = 0
    if "estimate" in node:
        estimate = int(reader.number(node, "estimate", f"{where}.estimate", WHOLE_COST, 0) or 0)
        if not after:
            reader.add(f"{where}.estimate", "needs charge: response (the cost comes after)")
    return [
        Client(n, phases, retries, weight, cost, tenant, group, after, held or 0.0, estimate)
        for n in names
    ]


def parse_clients(reader: Reader, raw: object, duration: float) -> tuple[Client, ...]:
    if not isinstance(raw, list) or not raw:
        reader.add("clients", "must be a non-empty list of clients")
        return ()
    out: list[Client] = []
    for i, item in enumerate(raw):
        node = reader.mapping(item, f"clients[{i}]", CLIENT_KEYS)
        clients = [] if node is None else _entry(reader, node, f"clients[{i}]", duration)
        for client in clients:
            if client.name and client.name in {c.name for c in out}:
                reader.add(f"clients[{i}].name", f"duplicate client '{client.name}'")
                break
            out.append(client)
    offered = sum(p.offered for c in out for p in c.phases if math.isfinite(p.stop))
    if offered > MAX_OFFERED:
        reader.add("clients", f"offer {offered} requests; a run simulates at most {MAX_OFFERED}")
    return tuple(out)
