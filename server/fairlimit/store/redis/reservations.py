"""Reservations of token budgets in Redis (core/reserve.py): the record keys, the admit
script's reservation tail, and settle.lua's arguments.

A record sits in the slot of its descriptor's counters (the same hash tag, so one call
reaches both on a Cluster): ``<prefix>{<tag>}v:<counter key>#rsv:<request id>``. The admit
script writes it (lua/admit/charge.lua: SET, expiring after max_duration) when it admits;
settle.lua reads and marks it settled, and moves the counters.
"""

import math
from collections.abc import Sequence

from fairlimit.core.plan import Plan
from fairlimit.core.reserve import Settle, own_counter, record_key
from fairlimit.store.redis.keys import SlotGroup, anchors, slot_groups

RECORD_KIND = "v"


def record_name(prefix: str, tag: str, counter: str, request_id: str) -> str:
    return f"{prefix}{{{tag}}}{RECORD_KIND}:{record_key(counter, request_id)}"


def admit_tail(
    plan: Plan, g: SlotGroup, prefix: str, cluster: bool
) -> tuple[list[str], list[str | int]]:
    """The record KEYS and the ARGV tail the admit script keeps reservations by, for the
    plan's reservations whose own counter is in group ``g`` (none: nothing is added)."""
    if not plan.reserve:
        return [], []
    tags = anchors(plan, cluster)
    keys: list[str] = []
    args: list[str | int] = []
    for reserve in plan.reserve:
        own = own_counter(plan, reserve.descriptor)
        if own is None or own not in g.counters:
            continue
        counter = plan.counters[own].key
        keys.append(record_name(prefix, tags[counter], counter, reserve.request_id))
        args += [reserve.hits, math.ceil(reserve.ttl * 1000), g.counters.index(own) + 1]
    return keys, ([len(keys), *args] if keys else [])


def usage_key(plan: Plan, own: int, prefix: str, cluster: bool) -> str:
    """The Redis key of ``plan``'s counter ``own`` (its fields s, n and r)."""
    (g,) = slot_groups(plan, prefix, cluster)  # one descriptor: its keys share a tag
    return g.counter_keys[g.counters.index(own)]


def records(plan: Plan, prefix: str, cluster: bool, groups: Sequence[SlotGroup]) -> list[str]:
    """The record keys the plan's reservations whose own counter is in ``groups`` are
    kept under."""
    tags = anchors(plan, cluster)
    out: list[str] = []
    for reserve in plan.reserve:
        own = own_counter(plan, reserve.descriptor)
        if own is not None and any(own in g.counters for g in groups):
            counter = plan.counters[own].key
            out.append(record_name(prefix, tags[counter], counter, reserve.request_id))
    return out


def settle_call(
    plan: Plan, settle: Settle, own: int, prefix: str, cluster: bool, now: str
) -> tuple[list[str], list[str | int]]:
    """KEYS and ARGV of settle.lua for the one descriptor of ``plan``."""
    (g,) = slot_groups(plan, prefix, cluster)  # one descriptor: its keys share a tag
    counter = plan.counters[own].key
    record = record_name(prefix, anchors(plan, cluster)[counter], counter, settle.request_id)
    keys = [*g.counter_keys, *[cap["rows"] for cap in g.cap_keys], record]
    mine = g.counters.index(own) + 1
    args: list[str | int] = [now, settle.amount, int(settle.negative), mine, len(g.counters)]
    args += [plan.counters[i].window for i in g.counters]
    args.append(len(g.caps))
    for i in g.cap_share:
        share = plan.shares[i]
        args += [repr(share.period), share.window]
    args.append(len(g.shares))
    for i in g.shares:
        share = plan.shares[i]
        args += [g.caps.index(share.cap) + 1, share.client]
    return keys, args
