"""A concurrency cap's state as one process has read it from acquire.lua, a bounded part a
call (issue 41), for the fair bound of its next acquire at that cap.

acquire.lua hands back a cap's held and want hashes whole while Redis keeps each as a
listpack (hash-max-listpack-entries: 512 fields by default in Redis 7.0), and otherwise one
HSCAN step of COUNT STATE_CHUNK from the cursor the caller gives, with the asking client's
own held and refused counts read fresh. A view keeps, per hash, what the last complete
pass read, updated by what the current pass has read so far; a field the current pass does
not find is dropped when it ends. So a client's entry is at most two passes old, a pass
being about ``fields / STATE_CHUNK`` of this process's acquires at the cap; with small
hashes every call reads them whole, and the view is the state after the previous call, as
before the steps. A want hash lives DEMAND_PERIOD from
its first refusal and is stamped when made: a part of a newer one starts the want view
afresh (the refusals before it are gone, as at a new demand period in memory), a part of an
older one is left out.
"""

import math
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass, field

from fairlimit.core.concurrency import CapDemand

STATE_CHUNK = 128  # acquire.lua's CHUNK
WHOLE = ""  # the cursor of a part that is the whole hash


def _client(name: str) -> str:
    return name[2:]


@dataclass(slots=True)
class HashView:
    """One hash of a cap (held or want) as read so far, pass by pass."""

    cursor: str = "0"  # where the next part starts ("0": a new pass)
    fields: dict[str, str] = field(default_factory=dict)
    seen: set[str] = field(default_factory=set)  # fields the current pass has read

    def take(self, start: str, cursor: str, flat: Sequence[str]) -> set[str]:
        """Take a part read from ``start`` ending at ``cursor``; returns the clients whose
        fields changed."""
        names = flat[::2]
        if cursor == WHOLE:
            whole, old = dict(zip(names, flat[1::2], strict=True)), self.fields
            changed = {_client(n) for n, v in whole.items() if old.get(n) != v}
            changed.update(_client(n) for n in old.keys() - whole.keys())
            self.fields, self.seen, self.cursor = whole, set(), "0"
            return changed
        changed = set()
        for name, value in zip(names, flat[1::2], strict=True):
            if self.fields.get(name) != value:
                self.fields[name] = value
                changed.add(_client(name))
        self.seen.update(names)
        if start != self.cursor:  # a call sent before the last part came back: its fields only
            return changed
        if cursor == "0":  # a pass is complete: what it did not find is gone
            for name in self.fields.keys() - self.seen:
                del self.fields[name]
                changed.add(_client(name))
            self.seen = set()
        self.cursor = cursor
        return changed

    def own(self, client: str, count: str | None, prefix: str, terms: tuple[str, str]) -> None:
        """Set ``client``'s own fields as the call read them (``count`` None: it has none)."""
        names = (prefix + client, "l:" + client, "w:" + client)
        if count is None:
            for name in names:
                self.fields.pop(name, None)
                self.seen.discard(name)
            return
        self.fields.update(zip(names, (count, *terms), strict=True))
        self.seen.update(names)


class CapView:
    """A cap's clients (their CapDemand) from the parts acquire.lua handed back."""

    __slots__ = ("at", "clients", "held", "stamp", "want", "weight_of")

    def __init__(self, at: float, weight_of: Callable[[str], float]) -> None:
        self.at = at  # the local time of the last part taken
        self.held, self.want, self.stamp = HashView(), HashView(), ""
        self.clients: dict[str, CapDemand] = {}
        self.weight_of = weight_of  # a client's weight before its w: field is read

    def reads(self) -> tuple[str, str, str]:
        """acquire.lua's held_cursor, want_cursor and want_stamp for this cap."""
        return self.held.cursor, self.want.cursor, self.stamp

    def take(self, at: float, sent: tuple[str, str, str], state: Sequence[object],
             own: tuple[str, float, float]) -> None:  # fmt: skip
        """Take one cap's state from a reply (acquire.lua's states entry without its index),
        for a call sent with ``sent`` (``reads()`` then), by the client ``own`` (name, limit,
        weight)."""
        held_cursor, held, stamp, want_cursor, want, own_held, own_refused = state
        self.at = max(self.at, at)
        changed = self.held.take(sent[0], _text(held_cursor), _texts(held))
        client, terms = own[0], (_num(own[1]), _num(own[2]))
        self.held.own(client, _maybe(own_held), "n:", terms)
        stamp = _text(stamp)
        if int(stamp) >= int(self.stamp or 0):
            if stamp != self.stamp:  # a newer want hash: the refusals before it are gone
                changed |= {_client(n) for n in self.want.fields}
                self.want, self.stamp = HashView(), stamp
            start = sent[1] if sent[2] == stamp else "0"
            changed |= self.want.take(start, _text(want_cursor), _texts(want))
            self.want.own(client, _maybe(own_refused), "r:", terms)
        changed.add(client)
        self._update(changed)

    def _update(self, clients: Iterable[str]) -> None:
        held, want = self.held.fields, self.want.fields
        for c in clients:
            n, r = held.get("n:" + c), want.get("r:" + c)
            if n is None and r is None:
                self.clients.pop(c, None)
                continue
            limit = held.get("l:" + c) or want.get("l:" + c)
            weight = held.get("w:" + c) or want.get("w:" + c)
            self.clients[c] = CapDemand(
                int(n or 0),
                int(r or 0),
                math.inf if limit is None else float(limit),
                self.weight_of(c) if weight is None else float(weight),
            )


def _num(x: float) -> str:
    return "inf" if x == math.inf else repr(float(x))


def _text(x: object) -> str:
    return x.decode() if isinstance(x, bytes) else str(x)


def _texts(flat: object) -> list[str]:
    assert isinstance(flat, list)
    return [_text(x) for x in flat]


def _maybe(x: object) -> str | None:
    return None if x is None else _text(x)
