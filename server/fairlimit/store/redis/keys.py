"""Redis key names: hash tags, the anchor of each counter, and a plan's slot groups.

On a Redis Cluster every key of a cap instance and of the counters below it starts with the
hash tag of the outermost cap over them (``{edge/route=public}``, braces and ``%``
percent-escaped), so a cap and its clients share one slot and one script call admits them
atomically; a counter under no cap is tagged by its own path. On one Redis (or Sentinel)
every key is tagged by its own path: there is one place anyway.
"""

from dataclasses import dataclass, field

from redis.crc import key_slot

from fairlimit.core.keys import key_path
from fairlimit.core.plan import Plan

COUNTER_KIND = "c"
# A cap's keys by kind; the scripts' KEYS name them (script.py states which each takes).
CAP_KINDS = {"meta": "m", "rows": "r", "lock": "l", "seen": "a"}


def tag(counter_key: str) -> str:
    """The hash tag text for a counter key: its path, with braces and % escaped."""
    path = key_path(counter_key)
    return path.replace("%", "%25").replace("{", "%7B").replace("}", "%7D")


def anchors(plan: Plan, cluster: bool) -> dict[str, str]:
    """Each counter key's tag: on a Cluster the outermost cap of its descriptor, else its
    own path.

    On one Redis every key is in the same place and a key's own path is its tag, so a key's
    name never depends on the request. On a Cluster a client's counter must sit in its
    cap's slot, and the outermost cap is known only from the plan: a request whose
    ``replaces`` drops that cap's limit counts the client under another key (documented).
    """
    found: dict[str, str] = {}
    for dplan in plan.descriptors if cluster else ():
        caps = [plan.shares[lv.share].cap for lv in dplan.charges if lv.share is not None]
        outer = caps[0] if caps else None  # levels list the caps outermost first
        for level in dplan.charges:
            key = plan.counters[level.counter].key
            found.setdefault(key, outer or key)
    for counter in plan.counters:
        found.setdefault(counter.key, counter.key)
    return {key: tag(anchor) for key, anchor in found.items()}


@dataclass(slots=True)
class SlotGroup:
    """The part of a plan that lives in one slot: one script call."""

    counters: list[int] = field(default_factory=list)
    shares: list[int] = field(default_factory=list)
    caps: list[str] = field(default_factory=list)  # distinct cap keys, first-seen order
    cap_share: list[int] = field(default_factory=list)  # a share index for each cap
    counter_keys: list[str] = field(default_factory=list)
    cap_keys: list[dict[str, str]] = field(default_factory=list)  # per cap: kind -> key


def slot_groups(plan: Plan, prefix: str, cluster: bool) -> list[SlotGroup]:
    """The plan's counters and shares grouped by the slot their keys hash to."""
    tags = anchors(plan, cluster)
    by_slot: dict[int, SlotGroup] = {}

    def name(key: str, kind: str, of: str) -> str:
        return f"{prefix}{{{tags[key]}}}{kind}:{of}"

    def group(key: str) -> SlotGroup:
        slot = key_slot(name(key, "", "").encode()) if cluster else 0
        return by_slot.setdefault(slot, SlotGroup())

    for i, counter in enumerate(plan.counters):
        group(counter.key).counters.append(i)
    for i, share in enumerate(plan.shares):
        g = group(share.cap)
        g.shares.append(i)
        if share.cap not in g.caps:
            g.caps.append(share.cap)
            g.cap_share.append(i)
    for g in by_slot.values():
        g.counter_keys = [
            name(plan.counters[i].key, COUNTER_KIND, plan.counters[i].key) for i in g.counters
        ]
        g.cap_keys = [
            {kind: name(cap, short, cap) for kind, short in CAP_KINDS.items()} for cap in g.caps
        ]
    return list(by_slot.values())
