"""Scenario files for `fairlimit simulate`, strictly checked (FILE: PATH: message).

Client entries are read by ``clients``, the reading itself is ``reader``'s.
"""

import dataclasses
import math
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from fairlimit.config.loader import yaml_mapping
from fairlimit.errors import ConfigError, ScenarioError
from fairlimit.simulate.clients import Client, parse_clients
from fairlimit.simulate.reader import Reader, Rule, after, within
from fairlimit.simulate.traffic import Phase

SCENARIO_KEYS = frozenset(
    {"name", "duration", "tick", "domain", "descriptor", "descriptors", "configs", "clients"}
    | {"steady", "seed", "rlqs"}
)
Template = tuple[tuple[str, str], ...]  # one descriptor's (key, value), {client} unfilled


@dataclass(frozen=True, slots=True)
class RlqsModel:
    """Run each config a second time with the clients behind RLQS Envoys: every client's
    requests alternate over ``envoys`` Envoys, each reporting every ``interval`` seconds."""

    envoys: int
    interval: float


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
    rlqs: RlqsModel | None = None


WHOLE_TICKS: Rule = (
    "a number that divides 1 s into whole ticks (0.01, 0.05, 0.1, 1, ...)",
    lambda x: 0 < x <= 1 and abs(1 / x - round(1 / x)) < 1e-6,
)


def _template(reader: Reader, raw: object, where: str) -> Template:
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


def _templates(reader: Reader, raw: Mapping[str, Any]) -> tuple[Template, ...]:
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


def _configs(reader: Reader, raw: object, base: Path) -> tuple[ConfigRef, ...]:
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


def _steady(reader: Reader, raw: object, duration: float) -> tuple[float, float]:
    start = 1.0 if duration > 1 else 0.0  # the first second: caps have no history yet
    node = {} if raw is None else reader.mapping(raw, "steady", frozenset({"start", "stop"}))
    if node is None:
        return start, duration
    start = reader.number(node, "start", "steady.start", within(0, duration), start) or 0.0
    rule = after(start, duration, "steady.start")
    return start, reader.number(node, "stop", "steady.stop", rule, duration) or duration


NOT_A_SCENARIO = (
    "a rate-limit config, not a scenario: a scenario needs name, duration, clients, a request"
    " template (descriptor or descriptors, each a list of {key, value}) and configs (each"
    " {label, path}, naming a config like this one); see 'Writing a scenario' in"
    " docs/fair-sharing.md"
)


def _is_config(raw: Mapping[str, Any]) -> bool:
    """Whether ``raw`` is a rate-limit config given as a scenario: its descriptors are rules
    (mappings; a scenario's are lists of {key, value}) and it has none of a scenario's own
    keys (a scenario with a mistaken template gets the template's errors)."""
    descriptors = raw.get("descriptors")
    rules = isinstance(descriptors, list) and any(isinstance(d, Mapping) for d in descriptors)
    return rules and not {"name", "duration", "clients", "configs"} & raw.keys()


def parse_scenario(text: str, source: str, base: Path) -> Scenario:
    """One scenario file's text -> Scenario; ScenarioError lists every problem."""
    try:
        raw = yaml_mapping(text, source, "a scenario")
    except ConfigError as exc:  # the YAML reader is the config loader's
        raise ScenarioError(exc.problems) from exc
    if _is_config(raw):
        raise ScenarioError([f"{source}: (file): {NOT_A_SCENARIO}"])
    reader = Reader(source)
    reader.mapping(raw, "(file)", SCENARIO_KEYS)
    name = reader.text(raw, "name", "name")
    # An unusable duration is reported once; the checks that depend on it are skipped.
    duration = reader.number(raw, "duration", "duration", within(0.01, 86400), None)
    span = math.inf if duration is None else duration
    tick = reader.number(raw, "tick", "tick", WHOLE_TICKS, 0.01) or 0.01
    domain = reader.text(raw, "domain", "domain")
    templates = _templates(reader, raw)
    configs = _configs(reader, raw.get("configs", []), base)
    clients = parse_clients(reader, raw.get("clients"), span)
    steady = _steady(reader, raw.get("steady"), span)
    seed = reader.integer(raw, "seed", "seed", 2**32) if "seed" in raw else 0
    rlqs = _rlqs(reader, raw.get("rlqs"))
    _check_tenants(reader, templates, clients)
    if reader.lines or duration is None:
        raise ScenarioError(reader.lines)
    return Scenario(
        name, source, duration, tick, domain, templates, configs, clients, steady, seed, rlqs
    )


def _rlqs(reader: Reader, raw: object) -> RlqsModel | None:
    if raw is None:
        return None
    node = reader.mapping(raw, "rlqs", frozenset({"envoys", "interval"}))
    if node is None:
        return None
    whole: Rule = ("a whole number from 1 to 100", lambda x: x == int(x) and 1 <= x <= 100)
    envoys = reader.number(node, "envoys", "rlqs.envoys", whole, 2.0) or 2.0
    interval = reader.number(node, "interval", "rlqs.interval", within(0.1, 3600), 5.0) or 5.0
    return RlqsModel(int(envoys), interval)


def _check_tenants(
    reader: Reader, templates: tuple[Template, ...], clients: tuple[Client, ...]
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


def at_phase(scenario: Scenario, phase: float) -> Scenario:
    """``scenario`` with every repeating phase (``every``: page loads, on/off cycles) moved
    to start at ``phase`` (0 to below 1) of the second it starts in: ``fairlimit simulate
    --phase``, the pages' phase as a parameter (issue 40)."""
    if not 0 <= phase < 1:
        raise ScenarioError([f"--phase: must be from 0 to below 1 (of a second), not {phase}"])

    def moved(p: Phase) -> Phase:
        if not p.every:
            return p
        return dataclasses.replace(p, start=round(math.floor(p.start) + phase, 6))

    clients = tuple(
        dataclasses.replace(c, phases=tuple(moved(p) for p in c.phases)) for c in scenario.clients
    )
    name = f"{scenario.name}, repeating phases at {phase:g} of their second"
    return dataclasses.replace(scenario, name=name, clients=clients)
