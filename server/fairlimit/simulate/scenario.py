"""Scenario files for `fairlimit simulate`, strictly checked (FILE: PATH: message).

A client entry is one client, or ``count`` identical ones (``name-1`` ... ``name-N``, drawn
as one band by ``plot``). Its traffic is ``rate``/``start``/``stop`` or a list of ``phases``
(``traffic.Phase``; ``every: 2, for: 0.2`` is an on/off cycle); ``cost`` is hits per
request (``traffic.Cost``); ``tenant`` fills the ``{tenant}`` placeholder of the request
template, as ``{client}`` takes its name; ``charge: response`` sends the request as Envoy's
two-phase flow does for token budgets: a check with ``hits_addend: 0`` first, then, once
admitted, the cost as a charge.
"""

import math
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from fairlimit.config.loader import yaml_mapping
from fairlimit.errors import ConfigError, ScenarioError
from fairlimit.simulate.traffic import Cost, Phase

MAX_RETRIES = 1_000_000
MAX_OFFERED = 10_000_000  # original requests per run: beyond, a run takes minutes
MAX_COUNT = 10_000  # identical clients per entry
MAX_COST = 1_000_000_000  # hits per request: Envoy's own bound on hits_addend
SCENARIO_KEYS = frozenset(
    {"name", "duration", "tick", "domain", "descriptor", "descriptors", "configs", "clients"}
    | {"steady", "seed"}
)
CLIENT_KEYS = frozenset(
    {"name", "rate", "retries", "weight", "start", "stop", "request_duration"}
    | {"phases", "cost", "count", "tenant", "group", "charge"}
)
# "for", not "on": YAML 1.1 reads a key `on` as the boolean true.
PHASE_KEYS = frozenset({"start", "stop", "rate", "every", "for", "burst"})
CHARGES = ("request", "response")
ONE_HIT = Cost()
Template = tuple[tuple[str, str], ...]  # one descriptor's (key, value), {client} unfilled
Rule = tuple[str, Callable[[float], bool]]  # what a number must be, and the test


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

    @property
    def active(self) -> float:
        """Seconds the client sends at its rates (bursts take no time)."""
        return sum(p.active for p in self.phases)


@dataclass(frozen=True, slots=True)
class ConfigRef:
    label: str
    path: Path  # resolved against the scenario file's directory


@dataclass(frozen=True, slots=True)
class Scenario:
    name: str
    source: str
    duration: float
    tick: float
    domain: str
    descriptors: tuple[Template, ...]
    configs: tuple[ConfigRef, ...]
    clients: tuple[Client, ...]
    steady: tuple[float, float]  # the part the fairness figures cover, in scenario seconds
    seed: int = 0  # for the costs drawn from a distribution


def _within(low: float, high: float, what: str = "a number") -> Rule:
    return f"{what} from {low:g} to {high:g}", lambda x: low <= x <= high


def _after(low: float, high: float, what: str) -> Rule:
    return f"a number above {what} ({low:g}) up to duration ({high:g})", lambda x: low < x <= high


ABOVE_ZERO: Rule = ("a number above 0", lambda x: x > 0)
WHOLE_TICKS: Rule = (
    "a number that divides 1 s into whole ticks (0.01, 0.05, 0.1, 1, ...)",
    lambda x: 0 < x <= 1 and abs(1 / x - round(1 / x)) < 1e-6,
)


class _Reader:
    """Reads one scenario file, collecting every problem as ``FILE: PATH: message``."""

    def __init__(self, source: str) -> None:
        self.source = source
        self.lines: list[str] = []

    def add(self, path: str, message: str) -> None:
        self.lines.append(f"{self.source}: {path}: {message}")

    def mapping(self, raw: object, path: str, keys: frozenset[str]) -> Mapping[str, Any] | None:
        if not isinstance(raw, dict):
            self.add(path, f"must be a mapping, not {raw!r}")
            return None
        for key in sorted(str(k) for k in raw if k not in keys):
            self.add(path, f"unknown key '{key}'")
        return raw

    def text(self, raw: Mapping[str, Any], key: str, path: str) -> str:
        value = raw.get(key)
        if isinstance(value, int | float) and not isinstance(value, bool):
            value = str(value)  # YAML reads `value: 42` as a number; Envoy sends text
        if not isinstance(value, str) or not value:
            self.add(path, "is required" if key not in raw else f"must be text, not {value!r}")
            return ""
        return value

    def number(
        self, raw: Mapping[str, Any], key: str, path: str, rule: Rule, default: float | None
    ) -> float | None:
        """``raw[key]`` if ``rule`` accepts it, ``default`` when absent, else None."""
        if key not in raw:
            if default is None:
                self.add(path, "is required")
            return default
        value = raw[key]
        ok = isinstance(value, int | float) and not isinstance(value, bool)
        if not ok or not math.isfinite(value) or not rule[1](value):
            self.add(path, f"must be {rule[0]}, not {value!r}")
            return None
        return float(value)


def _template(reader: _Reader, raw: object, where: str) -> Template:
    if not isinstance(raw, list) or not raw:
        reader.add(where, "must be a non-empty list of {key, value}")
        return ()
    entries = []
    for j, entry in enumerate(raw):
        node = reader.mapping(entry, f"{where}[{j}]", frozenset({"key", "value"}))
        if node is not None:
            key = reader.text(node, "key", f"{where}[{j}].key")
            entries.append((key, reader.text(node, "value", f"{where}[{j}].value")))
    return tuple(entries)


def _templates(reader: _Reader, raw: Mapping[str, Any]) -> tuple[Template, ...]:
    if ("descriptor" in raw) == ("descriptors" in raw):
        reader.add("(file)", "give the request template as 'descriptor' or 'descriptors'")
        return ()
    if "descriptor" in raw:
        out: tuple[Template, ...] = (_template(reader, raw["descriptor"], "descriptor"),)
        where = "descriptor"
    elif not isinstance(raw["descriptors"], list) or not raw["descriptors"]:
        reader.add("descriptors", "must be a non-empty list of descriptors")
        return ()
    else:
        items = raw["descriptors"]
        out = tuple(_template(reader, d, f"descriptors[{i}]") for i, d in enumerate(items))
        where = "descriptors"
    if not any("{client}" in v for t in out for _, v in t) and not reader.lines:
        message = "no value holds the {client} placeholder: every client would look the same"
        reader.add(where, message)
    return out


def _configs(reader: _Reader, raw: object, base: Path) -> tuple[ConfigRef, ...]:
    if not isinstance(raw, list):
        reader.add("configs", "must be a list of {label, path}")
        return ()
    out: list[ConfigRef] = []
    for i, item in enumerate(raw):
        node = reader.mapping(item, f"configs[{i}]", frozenset({"label", "path"}))
        if node is None:
            continue
        label = reader.text(node, "label", f"configs[{i}].label")
        path = reader.text(node, "path", f"configs[{i}].path")
        if label and label in {c.label for c in out}:
            reader.add(f"configs[{i}].label", f"duplicate label '{label}'")
        elif path and not (base / path).is_file():
            reader.add(f"configs[{i}].path", f"no such file: {base / path}")
        elif label and path:
            out.append(ConfigRef(label, base / path))
    return tuple(out)


def _retries(reader: _Reader, raw: object, path: str) -> Retries:
    node = reader.mapping(raw, path, frozenset({"max", "backoff"}))
    if node is None:
        return Retries()
    count = node.get("max", 0)
    if isinstance(count, bool) or not isinstance(count, int) or not 0 <= count <= MAX_RETRIES:
        reader.add(f"{path}.max", f"must be an integer from 0 to {MAX_RETRIES}, not {count!r}")
        count = 0
    backoff = reader.number(node, "backoff", f"{path}.backoff", _within(0, 3600), 0.0)
    return Retries(count, backoff or 0.0)


def _integer(reader: _Reader, node: Mapping[str, Any], key: str, path: str, top: int) -> int:
    value = node.get(key, 0)
    if isinstance(value, bool) or not isinstance(value, int) or not 0 <= value <= top:
        reader.add(path, f"must be an integer from 0 to {top}, not {value!r}")
        return 0
    return value


def _phase(reader: _Reader, raw: object, where: str, duration: float) -> Phase | None:
    node = reader.mapping(raw, where, PHASE_KEYS)
    if node is None:
        return None

    def number(key: str, rule: Rule, default: float | None) -> float:
        return reader.number(node, key, f"{where}.{key}", rule, default) or 0.0

    start = number("start", _within(0, duration), 0.0)
    stop = number("stop", _after(start, duration, "start"), duration) or duration
    rate = number("rate", _within(0, 1e7), 0.0)
    every = number("every", ABOVE_ZERO, 0.0)
    on = number("for", _within(0, every, "seconds on, a number"), 0.0) if every else 0.0
    if every and not on:
        reader.add(f"{where}.for", "must be above 0 when 'every' is given")
    burst = _integer(reader, node, "burst", f"{where}.burst", MAX_OFFERED)
    if not rate and not burst:
        reader.add(where, "sends nothing: give a rate above 0 or a burst")
    return Phase(start, stop, rate, every, on, burst)


def _phases(
    reader: _Reader, node: Mapping[str, Any], where: str, duration: float
) -> tuple[Phase, ...]:
    if "phases" not in node:
        rate = reader.number(node, "rate", f"{where}.rate", ABOVE_ZERO, None) or 1.0
        start = reader.number(node, "start", f"{where}.start", _within(0, duration), 0.0) or 0.0
        rule = _after(start, duration, "start")
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


def _costs(reader: _Reader, raw: object, where: str, two: bool) -> tuple[int, ...]:
    """A list of whole costs (exactly two when ``two``); () after reporting a problem."""
    if not isinstance(raw, list) or not raw or (two and len(raw) != 2):
        reader.add(where, "must be [low, high]" if two else "must be a non-empty list of integers")
        return ()
    numbers = [reader.number({"v": v}, "v", where, WHOLE_COST, None) for v in raw]
    return () if None in numbers else tuple(int(n or 0) for n in numbers)


def _weights(reader: _Reader, raw: object, where: str, n: int) -> tuple[float, ...]:
    numbers = raw if isinstance(raw, list) and len(raw) == n else []
    if not numbers or not all(
        isinstance(w, int | float) and not isinstance(w, bool) and w > 0 for w in numbers
    ):
        reader.add(where, f"must be {n} numbers above 0, one per value")
        return ()
    return tuple(float(w) for w in numbers)


def _cost(reader: _Reader, raw: object, where: str) -> Cost:
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


def _entry(reader: _Reader, node: Mapping[str, Any], where: str, duration: float) -> list[Client]:
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
    count = _integer(reader, node, "count", f"{where}.count", MAX_COUNT) if "count" in node else 1
    if not count:
        reader.add(f"{where}.count", "must be at least 1")
    names = [name] if count == 1 else [f"{name}-{i}" for i in range(1, count + 1)]
    group = group or name
    after = charge == "response"
    held = reader.number(
        node, "request_duration", f"{where}.request_duration", _within(0, 86400), 0.0
    )
    return [
        Client(n, phases, retries, weight, cost, tenant, group, after, held or 0.0) for n in names
    ]


def _clients(reader: _Reader, raw: object, duration: float) -> tuple[Client, ...]:
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


def _steady(reader: _Reader, raw: object, duration: float) -> tuple[float, float]:
    start = 1.0 if duration > 1 else 0.0  # the first second: caps have no history yet
    node = {} if raw is None else reader.mapping(raw, "steady", frozenset({"start", "stop"}))
    if node is None:
        return start, duration
    start = reader.number(node, "start", "steady.start", _within(0, duration), start) or 0.0
    rule = _after(start, duration, "steady.start")
    return start, reader.number(node, "stop", "steady.stop", rule, duration) or duration


def parse_scenario(text: str, source: str, base: Path) -> Scenario:
    """One scenario file's text -> Scenario; ScenarioError lists every problem."""
    try:
        raw = yaml_mapping(text, source, "a scenario")
    except ConfigError as exc:  # the YAML reader is the config loader's
        raise ScenarioError(exc.problems) from exc
    reader = _Reader(source)
    reader.mapping(raw, "(file)", SCENARIO_KEYS)
    name = reader.text(raw, "name", "name")
    # An unusable duration is reported once; the checks that depend on it are skipped.
    duration = reader.number(raw, "duration", "duration", _within(0.01, 86400), None)
    span = math.inf if duration is None else duration
    tick = reader.number(raw, "tick", "tick", WHOLE_TICKS, 0.01) or 0.01
    domain = reader.text(raw, "domain", "domain")
    templates = _templates(reader, raw)
    configs = _configs(reader, raw.get("configs", []), base)
    clients = _clients(reader, raw.get("clients"), span)
    steady = _steady(reader, raw.get("steady"), span)
    seed = _integer(reader, raw, "seed", "seed", 2**32) if "seed" in raw else 0
    _check_tenants(reader, templates, clients)
    if reader.lines or duration is None:
        raise ScenarioError(reader.lines)
    return Scenario(name, source, duration, tick, domain, templates, configs, clients, steady, seed)


def _check_tenants(
    reader: _Reader, templates: tuple[Template, ...], clients: tuple[Client, ...]
) -> None:
    """A template naming ``{tenant}`` needs every client's tenant."""
    if any("{tenant}" in v for t in templates for _, v in t):
        for name in (c.name for c in clients if not c.tenant):
            reader.add("clients", f"client '{name}' has no tenant for the {{tenant}} placeholder")
            return


def load_scenario(path: str | Path) -> Scenario:
    """Read and check the scenario at ``path`` (config paths are relative to its directory)."""
    try:
        text = Path(path).read_text(encoding="utf-8")
    except (OSError, UnicodeDecodeError) as exc:
        raise ScenarioError([f"{path}: (file): cannot read: {exc}"]) from exc
    return parse_scenario(text, str(path), Path(path).parent)
