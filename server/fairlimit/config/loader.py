"""Descriptor YAML -> ``core.rules``: strict keys, every problem as ``FILE: PATH: message``.

Loading is all or nothing: any problem in any file rejects the whole set.
"""

import math
from collections.abc import Iterable, Mapping, Sequence
from pathlib import Path
from types import MappingProxyType
from typing import Any

import yaml

from fairlimit.config.limits import node_limits
from fairlimit.config.source import ALLOW, empty_problems
from fairlimit.config.yaml_text import (
    Plain,
    as_bool,
    as_int,
    as_number,
    read_text_yaml,
    typed,
    unreadable,
)
from fairlimit.core import concurrency
from fairlimit.core.rules import (
    ACQUIRE_KEY,
    RELEASE_KEY,
    Concurrency,
    Config,
    Domain,
    FairShare,
    Loaded,
    RateLimit,
    Reservation,
    Rule,
)
from fairlimit.core.validation import classify
from fairlimit.core.values import MAX_TEXT
from fairlimit.errors import ConfigError, ConfigUnreadable, ConfigWarningError

ROOT_KEYS = frozenset({"domain", "descriptors", "request_id_keys"})
DESCRIPTOR_KEYS = frozenset(
    {"key", "value", "rate_limit", "rate_limits", "descriptors", "shadow_mode", "detailed_metric",
     "fair_share", "quota_mode", "value_to_metric", "share_threshold", "metadata", "concurrency",
     "quota_group", "reservation"}
)  # fmt: skip
CONCURRENCY_KEYS = frozenset({"max_in_flight", "max_duration", "released_by"})
RELEASED_BY = ("request_id", "negative_hits")
RESERVATION_KEYS = frozenset({"default", "max_duration"})
REQUEST_ID_KEYS = frozenset({"acquire", "release"})
FAIR_SHARE_KEYS = frozenset({"active_clients", "weights"})
YAML_SUFFIXES = (".yaml", ".yml")
_OCTAL_HINT = " (upstream reads a leading zero as octal: write it without)"
CAP_SHAPE = (
    "fair_share caps count fixed windows: its limits cannot be sliding, gcra or calendar "
    "(the clients' limits below may)"
)


class Problems:
    """Every problem of one file, each as ``FILE: PATH: message`` (scenario files too)."""

    def __init__(self, source: str) -> None:
        self.source = source
        self.lines: list[str] = []

    def add(self, path: str, message: str) -> None:
        self.lines.append(f"{self.source}: {path}: {message}")


def _unknown_keys(node: Mapping[Any, Any], allowed: frozenset[str]) -> list[str]:
    return sorted(str(k) for k in node if k not in allowed)


def _int_in(value: object, low: int, high: int) -> int | None:
    """``value`` (plain decimal text) as an integer within [low, high], else None."""
    number = as_int(value)
    return number if number is not None and low <= number <= high else None


def _octal(value: object) -> bool:
    return isinstance(value, Plain) and len(value) > 1 and value.startswith("0")


def _shown(value: object) -> str:
    """A scalar for a message: plain text as written, anything else (quoted text) as repr."""
    return str(value) if isinstance(value, Plain) else repr(value)


def _check_keys(
    problems: Problems, path: str, node: Mapping[Any, Any], allowed: frozenset[str]
) -> None:
    for key in _unknown_keys(node, allowed):
        problems.add(path, f"unknown key '{key}'")


def _bool(problems: Problems, path: str, node: Mapping[str, Any], key: str) -> bool:
    raw = node.get(key)
    value = False if raw is None else as_bool(raw)
    if value is None:
        problems.add(path, f"'{key}' must be true or false, not {raw!r}")
        return False
    return value


def _weights(problems: Problems, path: str, raw: object) -> Mapping[str, float]:
    if raw is None:
        return MappingProxyType({})
    if not isinstance(raw, dict):
        problems.add(path, "fair_share.weights must map client values to numbers")
        return MappingProxyType({})
    weights: dict[str, float] = {}
    for client, weight in raw.items():
        number = as_number(weight)
        if number is None or not math.isfinite(number) or number <= 0:
            problems.add(path, f"fair_share.weights['{client}'] must be a number above 0")
            continue
        weights[str(client)] = float(number)
    return MappingProxyType(weights)


def _concurrency(problems: Problems, path: str, raw: object) -> Concurrency | None:
    if not isinstance(raw, dict):
        problems.add(path, "concurrency must be a mapping")
        return None
    _check_keys(problems, path, raw, CONCURRENCY_KEYS)
    raw_max = raw.get("max_in_flight")
    most = _int_in(raw_max, 1, 10**9)
    if most is None:
        problems.add(
            path,
            "concurrency.max_in_flight must be an integer from 1 to 1000000000, "
            f"not {_shown(raw_max)}",
        )
    raw_duration = raw.get("max_duration")
    duration = 300.0 if raw_duration is None else as_number(raw_duration)
    if duration is None or not 0 < duration <= 86400 * 7:
        problems.add(
            path,
            f"concurrency.max_duration must be seconds in (0, 604800], not {_shown(raw_duration)}",
        )
        return None
    released = raw.get("released_by", RELEASED_BY[0])
    if released not in RELEASED_BY:
        problems.add(
            path,
            f"concurrency.released_by must be request_id or negative_hits, not {_shown(released)}",
        )
        return None
    return None if most is None else Concurrency(most, duration, str(released))


def _reservation(
    problems: Problems, path: str, raw: object, limit: RateLimit | None
) -> Reservation | None:
    if not isinstance(raw, dict):
        problems.add(path, "reservation must be a mapping")
        return None
    _check_keys(problems, path, raw, RESERVATION_KEYS)
    raw_default = raw.get("default")
    default = None if raw_default is None else _int_in(raw_default, 1, 0xFFFFFFFF)
    if raw_default is not None and default is None:
        problems.add(
            path,
            "reservation.default must be an integer from 1 to 4294967295, "
            f"not {_shown(raw_default)}",
        )
    raw_duration = raw.get("max_duration")
    duration = 300.0 if raw_duration is None else as_number(raw_duration)
    if duration is None or not 0 < duration <= 86400 * 7:
        problems.add(
            path,
            f"reservation.max_duration must be seconds in (0, 604800], not {_shown(raw_duration)}",
        )
        duration = 300.0
    if limit is None or limit.unlimited:
        problems.add(path, "reservation needs a limited rate_limit on the same node: the budget")
    return Reservation(default, duration)


def _request_id_keys(problems: Problems, domain: str, raw: object) -> tuple[str, str]:
    if raw is None:
        return ACQUIRE_KEY, RELEASE_KEY
    if not isinstance(raw, dict):
        problems.add(domain, "request_id_keys must be a mapping of acquire and release")
        return ACQUIRE_KEY, RELEASE_KEY
    _check_keys(problems, domain, raw, REQUEST_ID_KEYS)
    acquire, release = raw.get("acquire", ACQUIRE_KEY), raw.get("release", RELEASE_KEY)
    if not (isinstance(acquire, str) and acquire and isinstance(release, str) and release):
        problems.add(domain, "request_id_keys.acquire and .release must be non-empty strings")
        return ACQUIRE_KEY, RELEASE_KEY
    if acquire == release:
        problems.add(domain, f"request_id_keys.acquire and .release must differ, both '{acquire}'")
    return str(acquire), str(release)


def _fair_share(
    problems: Problems,
    path: str,
    raw: object,
    limit: RateLimit | None,
    has_children: bool,
    slots: Concurrency | None = None,
) -> FairShare | None:
    if not isinstance(raw, dict):
        problems.add(path, "fair_share must be a mapping")
        return None
    _check_keys(problems, path, raw, FAIR_SHARE_KEYS)
    raw_active = raw.get("active_clients")
    active = _int_in(raw_active, 1, 10**9)
    weights = _weights(problems, path, raw.get("weights"))
    if active is None:
        problems.add(
            path,
            "fair_share.active_clients must be an integer from 1 to 1000000000, "
            f"not {_shown(raw_active)}",
        )
    if (limit is None or limit.unlimited) and slots is None:
        problems.add(path, "fair_share needs a limited rate_limit on the same node: the cap")
    elif limit is not None and limit.unlimited:  # else read as a rate cap of 0: refusing all
        problems.add(
            path,
            "fair_share cannot cap with an unlimited rate_limit: "
            "remove it to cap by concurrency alone",
        )
    if not has_children:
        problems.add(path, "fair_share needs child descriptors: the per-client buckets")
    # a problem rejects the whole file (parse_root), so what is returned with one goes unseen
    return None if active is None else FairShare(active, weights)


def _label(key: str, value: str | None) -> str:
    return key if value is None else f"{key}={value}"


def _metadata(problems: Problems, path: str, raw: object) -> Mapping[str, object] | None:
    if raw is None:
        return None
    if not isinstance(raw, dict):
        problems.add(path, "metadata must be a mapping")
        return None
    return MappingProxyType(typed(raw))


def _quota_group(problems: Problems, path: str, raw: Mapping[str, Any]) -> str | None:
    """The rule's quota group: a name, only on a quota_mode rule (else it groups nothing)."""
    group = raw.get("quota_group")
    if group is None:
        return None
    if not isinstance(group, str) or not group:
        problems.add(path, f"quota_group must be a non-empty string, not {_shown(group)}")
        return None
    if raw.get("quota_mode") is None or as_bool(raw["quota_mode"]) is not True:
        problems.add(path, "quota_group needs quota_mode: true on the same descriptor")
        return None
    return str(group)


def _share_threshold(problems: Problems, path: str, raw: Mapping[str, Any], value: str | None,
                     ) -> bool:  # fmt: skip
    shared = _bool(problems, path, raw, "share_threshold")
    if shared and (value is None or "*" not in value):
        problems.add(path, "share_threshold can only be used with a wildcard value (with '*')")
        return False
    return shared


# A request whose domain or key passes MAX_TEXT is refused (INVALID_ARGUMENT: they are
# Envoy's configuration, not a client's choice), and Envoy lets a refused call's request
# through: a rule naming one would never limit anything.
UNMATCHED = "Envoy's requests carrying it are refused, and Envoy lets them through unlimited"


def _descriptor(problems: Problems, parent: str, index: int, raw: object) -> Rule | None:
    here = f"{parent}/descriptors[{index}]"
    if not isinstance(raw, dict):
        problems.add(here, "each descriptor must be a mapping")
        return None
    key = raw.get("key")
    if not isinstance(key, str) or not key:
        problems.add(here, "descriptor has empty key")
        return None
    if len(key) > MAX_TEXT:
        problems.add(here, f"descriptor key longer than {MAX_TEXT} characters: {UNMATCHED}")
        return None
    key, value = str(key), raw.get("value")
    if value is not None and not isinstance(value, str):
        problems.add(here, f"descriptor value must be a string, not {value!r}")
        value = None
    text = None if value is None or value == "" else str(value)  # the text written, as upstream
    path = f"{parent}/{_label(key, text)}"
    _check_keys(problems, path, raw, DESCRIPTOR_KEYS)
    limits = node_limits(problems, path, raw)
    limit = limits[0] if limits else None
    children = _descriptors(problems, path, raw.get("descriptors"))
    slots = _concurrency(problems, path, raw["concurrency"]) if "concurrency" in raw else None
    fair = None
    if "fair_share" in raw:
        fair = _fair_share(problems, path, raw["fair_share"], limit, bool(children), slots)
        if any(each.shape is not None for each in limits):
            problems.add(path, CAP_SHAPE)
    reserve = None
    if "reservation" in raw:
        reserve = _reservation(problems, path, raw["reservation"], limit)
        if fair is not None:
            problems.add(path, "reservation belongs on the per-client descriptors below a "
                         "fair_share cap, not on the cap")  # fmt: skip
        if slots is not None:
            problems.add(path, "reservation and concurrency cannot share a node: both pair by "
                         "request id (put them on two descriptors)")  # fmt: skip
        if len(limits) > 1 or any(each.shape is not None for each in limits):
            problems.add(path, "reservation settles one fixed-window rate_limit: not "
                         "rate_limits, sliding, gcra or calendar windows")  # fmt: skip
    return Rule(
        key=key,
        value=text,
        path=path,
        source=problems.source,
        rate_limit=limit,
        more_limits=limits[1:],
        shadow_mode=_bool(problems, path, raw, "shadow_mode"),
        detailed_metric=_bool(problems, path, raw, "detailed_metric"),
        fair_share=fair,
        children=children,
        quota_mode=_bool(problems, path, raw, "quota_mode"),
        value_to_metric=_bool(problems, path, raw, "value_to_metric"),
        share_threshold=_share_threshold(problems, path, raw, text),
        metadata=_metadata(problems, path, raw.get("metadata")),
        concurrency=slots,
        quota_group=_quota_group(problems, path, raw),
        reservation=reserve,
    )


def _descriptors(problems: Problems, parent: str, raw: object) -> tuple[Rule, ...]:
    if raw is None:
        return ()
    if not isinstance(raw, list):
        problems.add(parent, "descriptors must be a list")
        return ()
    rules: list[Rule] = []
    seen: set[tuple[str, str | None]] = set()
    for index, item in enumerate(raw):
        rule = _descriptor(problems, parent, index, item)
        if rule is None:
            continue
        if (rule.key, rule.value) in seen:
            problems.add(rule.path, "duplicate descriptor composite key")
            continue
        seen.add((rule.key, rule.value))
        rules.append(rule)
    return tuple(rules)


def yaml_mapping(text: str, source: str, what: str) -> dict[Any, Any]:
    """``text`` parsed as one YAML mapping; ConfigUnreadable names line and column if not."""
    try:
        raw = yaml.safe_load(text)
    except yaml.YAMLError as exc:
        raise unreadable(exc, source) from exc
    if not isinstance(raw, dict):
        raise ConfigUnreadable([f"{source}: (file): {what} must be a YAML mapping"])
    return raw


def parse_domain(text: str, source: str) -> Domain:
    """One descriptor file's text -> its Domain; ConfigError lists every problem.

    Scalars are read as the text written and a repeated key is an error (``yaml_text``).
    """
    raw = read_text_yaml(text, source)
    if not isinstance(raw, dict):
        raise ConfigUnreadable([f"{source}: (file): a descriptor file must be a YAML mapping"])
    return parse_root(raw, source)


def parse_root(raw: Mapping[Any, Any], source: str) -> Domain:
    """One config root (``domain`` and ``descriptors``) -> its Domain; ConfigError if wrong."""
    domain = raw.get("domain")
    problems = Problems(source)
    if not isinstance(domain, str) or not domain:
        problems.add("(file)", "config file cannot have empty domain")
        domain = "(no domain)"
    elif len(domain) > MAX_TEXT:
        problems.add("(file)", f"domain longer than {MAX_TEXT} characters: {UNMATCHED}")
        domain = domain[:40] + "..."
    domain = str(domain)
    _check_keys(problems, domain, raw, ROOT_KEYS)
    rules = _descriptors(problems, domain, raw.get("descriptors"))
    acquire, release = _request_id_keys(problems, domain, raw.get("request_id_keys"))
    if problems.lines:
        raise ConfigError(problems.lines)
    return Domain(domain, source, rules, acquire, release)


def config_files(paths: Iterable[str | Path], *, ignore_dotfiles: bool = False) -> list[Path]:
    """The descriptor files named by ``paths``: files as given, ``*.yaml``/``*.yml`` of dirs
    (those whose name starts with a dot left out when ``ignore_dotfiles``, upstream's
    RUNTIME_IGNOREDOTFILES)."""
    files: list[Path] = []
    missing: list[str] = []
    for item in paths:
        path = Path(item)
        if path.is_dir():
            files.extend(
                sorted(
                    p
                    for p in path.iterdir()
                    if p.suffix in YAML_SUFFIXES
                    and not (ignore_dotfiles and p.name.startswith("."))
                    and p.is_file()
                )
            )
        elif path.is_file():
            files.append(path)
        else:
            missing.append(f"{path}: (file): no such file or directory")
    if missing:
        raise ConfigUnreadable(missing)
    return files


def _read(path: Path) -> str:
    try:
        return path.read_text(encoding="utf-8")
    except (OSError, UnicodeDecodeError) as exc:
        raise ConfigUnreadable([f"{path}: (file): cannot read: {exc}"]) from exc


def _merge(first: Domain, later: Domain) -> tuple[Domain, list[str]]:
    """``later``'s top-level descriptors added to ``first``'s (MERGE_DOMAIN_CONFIG)."""
    seen = {(r.key, r.value) for r in first.rules}
    clashes = [
        f"{later.source}: {r.path}: duplicate descriptor composite key (also in {first.source})"
        for r in later.rules
        if (r.key, r.value) in seen
    ]
    rules = first.rules + later.rules
    return Domain(first.name, first.source, rules, first.acquire_key, first.release_key), clashes


def assemble(
    domains: Iterable[Domain], files: Sequence[Path], *, strict: bool = False,
    merge_domains: bool = False, charge_over_limit: bool = False,
) -> Loaded:  # fmt: skip
    """Parsed domains -> the Loaded config, all or nothing (ConfigError, ConfigWarningError).

    Two sources of one domain are an error, unless ``merge_domains`` (upstream's
    MERGE_DOMAIN_CONFIG) adds the later one's descriptors to the first.
    ``charge_over_limit``: what a limit that does not say ``charge_when_over_limit`` does.
    """
    by_name: dict[str, Domain] = {}
    lines: list[str] = []
    for domain in domains:
        known = by_name.get(domain.name)
        if known is None:
            by_name[domain.name] = domain
        elif merge_domains:
            by_name[domain.name], clashes = _merge(known, domain)
            lines.extend(clashes)
        else:
            lines.append(
                f"{domain.source}: {domain.name}: duplicate domain '{domain.name}' "
                f"(first in {known.source})"
            )
    if lines:
        raise ConfigError(lines)
    config = Config.of(list(by_name.values()), charge_over_limit)
    loaded = Loaded(
        config, tuple(classify(config)), tuple(files), tuple(concurrency.classify(config))
    )
    if strict and loaded.warnings:
        raise ConfigWarningError(loaded.warnings)
    return loaded


def _empty(paths: Sequence[str | Path], config: Config, ignore_dotfiles: bool) -> list[str]:
    """Why ``config`` loaded from ``paths`` would switch limiting off: a directory given that
    holds no descriptor file (a ConfigMap whose key or ``..data`` link went), or not one
    rate or concurrency limit in the whole set."""
    lines = [
        f"{path}: (directory): no descriptor files (*.yaml, *.yml): {ALLOW}"
        for path in map(Path, paths)
        if path.is_dir() and not config_files([path], ignore_dotfiles=ignore_dotfiles)
    ]
    return lines or empty_problems(config, ", ".join(str(p) for p in paths))


def load(
    paths: Sequence[str | Path],
    *,
    strict: bool = False,
    merge_domains: bool = False,
    allow_empty: bool = False,
    charge_over_limit: bool = False,
    ignore_dotfiles: bool = False,
) -> Loaded:
    """Load every descriptor file under ``paths``, all or nothing (``charge_over_limit``:
    see ``assemble``; ``ignore_dotfiles``: see ``config_files``).

    Raises ConfigUnreadable for paths that cannot be read at all, ConfigError for rule
    problems and for a config that limits nothing (a directory without descriptor files,
    or no limit anywhere) unless ``allow_empty``, and ConfigWarningError when ``strict``
    and any cap or bucket draws a warning.
    """
    files = config_files(paths, ignore_dotfiles=ignore_dotfiles)
    domains: list[Domain] = []
    lines: list[str] = []
    unreadable = False
    for path in files:
        try:
            domains.append(parse_domain(_read(path), str(path)))
        except ConfigError as exc:
            unreadable = unreadable or isinstance(exc, ConfigUnreadable)
            lines.extend(exc.problems)
    if lines:
        raise (ConfigUnreadable if unreadable else ConfigError)(lines)
    loaded = assemble(
        domains, files, strict=strict, merge_domains=merge_domains,
        charge_over_limit=charge_over_limit,
    )  # fmt: skip
    empty = [] if allow_empty else _empty(paths, loaded.config, ignore_dotfiles)
    if empty:
        raise ConfigError(empty)
    return loaded
