"""A report's lines and a division's assignments in columns, as the RLQS servicer and the
quota service trade them (issue 41): a periodic report of 50,000 lines as ``Usage`` objects,
and its 50,000 renewals as ``Assign`` tuples, cost their making and the cyclic collector's
passes over them. Each is a sequence whose items are made only when read (tests and the
simulator read them so); the intake (``reports.py``) and the servicer
(``grpc_api/rlqs.py``) read the columns.
"""

from collections.abc import Callable, Iterator, Mapping, Sequence
from itertools import repeat
from typing import cast, overload

import numpy as np
import numpy.typing as npt

from fairlimit.core.quota import Strategy
from fairlimit.quota.stream import Action, Assign, Usage


class Lines(Sequence[Usage]):
    """A report's lines: each line's bucket, and its allowed and denied counts as uint64
    arrays (as Envoy sends them)."""

    __slots__ = ("allowed", "buckets", "denied")

    def __init__(
        self,
        buckets: Sequence[Mapping[str, str]],
        allowed: npt.NDArray[np.uint64],
        denied: npt.NDArray[np.uint64],
    ) -> None:
        if not len(buckets) == len(allowed) == len(denied):
            raise ValueError("a report's columns differ in length")
        self.buckets, self.allowed, self.denied = buckets, allowed, denied

    def __len__(self) -> int:
        return len(self.buckets)

    @overload
    def __getitem__(self, index: int) -> Usage: ...

    @overload
    def __getitem__(self, index: slice) -> Sequence[Usage]: ...

    def __getitem__(self, index: int | slice) -> Usage | Sequence[Usage]:
        if isinstance(index, slice):
            return Lines(self.buckets[index], self.allowed[index], self.denied[index])
        return Usage(self.buckets[index], int(self.allowed[index]), int(self.denied[index]))


_new_tuple = cast(Callable[[type, tuple[object, ...]], Assign], tuple.__new__)


class Assigns(Sequence[Action]):
    """Actions: ``head`` as they are, then an ``Assign`` per bucket of ``buckets`` with the
    strategy at its place in ``strategies``, each for ``ttl`` seconds."""

    __slots__ = ("buckets", "head", "strategies", "ttl")

    def __init__(
        self,
        head: Sequence[Action],
        buckets: Sequence[Mapping[str, str]],
        strategies: Sequence[Strategy],
        ttl: int,
    ) -> None:
        self.head, self.buckets, self.strategies, self.ttl = head, buckets, strategies, ttl

    def __len__(self) -> int:
        return len(self.head) + len(self.buckets)

    def __iter__(self) -> Iterator[Action]:
        yield from self.head
        yield from map(_new_tuple, repeat(Assign),
                       zip(self.buckets, self.strategies, repeat(self.ttl)))  # fmt: skip

    @overload
    def __getitem__(self, index: int) -> Action: ...

    @overload
    def __getitem__(self, index: slice) -> Sequence[Action]: ...

    def __getitem__(self, index: int | slice) -> Action | Sequence[Action]:
        if isinstance(index, slice):
            return list(self)[index]
        n = len(self.head)
        index = range(len(self))[index]  # IndexError past the end, negatives counted back
        if index < n:
            return self.head[index]
        return Assign(self.buckets[index - n], self.strategies[index - n], self.ttl)

    def __repr__(self) -> str:
        return f"Assigns({list(self)!r})"
