"""The Redis backend (standalone, TLS, Sentinel, Cluster) behind the Store contract.

What each module owns:

- ``keys.py``: key names, hash tags, the anchor cap of each counter, a plan's slot groups
- ``script.py``: the KEYS/ARGV contract with ``lua/`` (layouts, argument builders, reply
  parsers, script registration)
- ``division.py``: a hand-back's division: the rows read, the division computed, inline or
  (a large cap) in the background (division.Background)
- ``division_rows.py``: the rows a division reads: those written lately, found by the
  cap's seen index in bounded steps
- ``lua/``: one script per operation: ``admit/`` (admission, with the division hand-back;
  one file per concept, joined into one script by script.py), ``release.lua`` (undo a
  reservation of a multi-slot request), ``acquire.lua`` and ``release_slot.lua``
  (concurrency slots), ``prune.lua`` (a cap's stale rows dropped a few at a time)
- ``slots.py``: the concurrency pools: their keys, the slot scripts' contract and calls
- ``store.py``: RedisStore (one call per slot group, two-phase across slots), delegating to:
- ``leasing.py``: this process's lease blocks and the refused hits on their way to Redis
- ``divisions.py``: the divisions a call hands back, made inline or left to the background,
  and their calls (hand-in, prune.lua)
- ``registry.py``: the cap registry caps() reads, and the demand exchange (demand.lua)
- ``replies.py``: a plan's replies, one per slot group, put together
- ``client.py``: the URL, its options and the redis-py client; Redis errors -> StoreUnavailable
- ``batch.py``: concurrent script calls coalesced into pipelines
- ``overlimit_cache.py``: the local cache that answers known-over clients without Redis
"""

from fairlimit.store.redis.client import client_for, parse_url
from fairlimit.store.redis.store import RedisStore

__all__ = ["RedisStore", "open_redis", "parse_url"]


def open_redis(url: str) -> RedisStore:
    """A RedisStore for a ``redis://``, ``rediss://``, ``redis+sentinel://`` or cluster URL."""
    parsed = parse_url(url)
    return RedisStore(client_for(parsed), parsed.options, cluster=parsed.scheme == "redis+cluster")
