"""Scenario files for `fairlimit simulate`, strictly checked (FILE: PATH: message)."""

import math
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from fairlimit.config.loader import yaml_mapping
from fairlimit.errors import ConfigError, ScenarioError

MAX_RETRIES = 1_000_000
MAX_OFFERED = 10_000_000  # original requests per run: beyond, a run takes minutes
SCENARIO_KEYS = frozenset(
    {"name", "duration", "tick", "domain", "descriptor", "descriptors", "configs", "clients"}
    | {"steady"}
)
CLIENT_KEYS = frozenset({"name", "rate", "retries", "weight", "start", "stop", "request_duration"})
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
    rate: float  # original requests per second
    retries: Retries
    weight: float  # informational: the config's fair_share.weights decide
    start: float
    stop: float
    # seconds an admitted request stays in flight (0: not modelled); with it, every request
    # carries a request id and its stream-done release follows, so concurrency caps apply
    request_duration: float = 0.0


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


def _client(reader: _Reader, node: Mapping[str, Any], where: str, duration: float) -> Client:
    def number(key: str, rule: Rule, default: float | None) -> float | None:
        return reader.number(node, key, f"{where}.{key}", rule, default)

    name = reader.text(node, "name", f"{where}.name")
    rate = number("rate", ABOVE_ZERO, None) or 1.0
    retries = (
        _retries(reader, node["retries"], f"{where}.retries") if "retries" in node else Retries()
    )
    weight = number("weight", ABOVE_ZERO, 1.0) or 1.0
    start = number("start", _within(0, duration), 0.0) or 0.0
    stop = number("stop", _after(start, duration, "start"), duration) or duration
    held = number("request_duration", _within(0, 86400), 0.0) or 0.0
    return Client(name, rate, retries, weight, start, stop, held)


def _clients(reader: _Reader, raw: object, duration: float) -> tuple[Client, ...]:
    if not isinstance(raw, list) or not raw:
        reader.add("clients", "must be a non-empty list of clients")
        return ()
    out: list[Client] = []
    for i, item in enumerate(raw):
        node = reader.mapping(item, f"clients[{i}]", CLIENT_KEYS)
        client = None if node is None else _client(reader, node, f"clients[{i}]", duration)
        if client and client.name and client.name in {c.name for c in out}:
            reader.add(f"clients[{i}].name", f"duplicate client '{client.name}'")
        elif client:
            out.append(client)
    offered = sum(math.ceil((c.stop - c.start) * c.rate) for c in out if math.isfinite(c.stop))
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
    if reader.lines or duration is None:
        raise ScenarioError(reader.lines)
    return Scenario(name, source, duration, tick, domain, templates, configs, clients, steady)


def load_scenario(path: str | Path) -> Scenario:
    """Read and check the scenario at ``path`` (config paths are relative to its directory)."""
    try:
        text = Path(path).read_text(encoding="utf-8")
    except (OSError, UnicodeDecodeError) as exc:
        raise ScenarioError([f"{path}: (file): cannot read: {exc}"]) from exc
    return parse_scenario(text, str(path), Path(path).parent)
