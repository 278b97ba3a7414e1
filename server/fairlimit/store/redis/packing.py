"""Redis connections whose commands hiredis packs in one C call.

redis-py (8.x) gives hiredis's ``pack_command`` the arguments only after encoding each one
in Python (a generator and up to five type checks an argument). An admit script call
carries the plan's limits, caps and client rows as arguments, 48 for a client under a fair
cap: packed that way it cost ~70 µs of CPU more than packed by hiredis alone
(bench/packing.py; docs/benchmarks.md, "Commands packed by hiredis"). hiredis packs str
(UTF-8, strict), int, float and bytes to the same bytes as redis-py
(tests/store/test_redis_packing.py compares them); anything else (a memoryview, a bool,
None), a command name with a space in it ("CONFIG GET", which redis-py splits) and a
connection with another encoding go redis-py's way, which packs or refuses them as it
always has.
"""

from hiredis import pack_command as _hiredis_pack  # redis[hiredis], a dependency
from redis.asyncio.connection import Connection, SSLConnection
from redis.asyncio.sentinel import SentinelManagedConnection, SentinelManagedSSLConnection
from redis.typing import EncodableT


def packed(connection: Connection, args: tuple[EncodableT, ...]) -> list[bytes] | None:
    """``args`` as one RESP command packed by hiredis, or None where redis-py must pack it."""
    if not args:
        return None
    head, encoder = args[0], connection.encoder
    if (isinstance(head, str) and " " in head) or (isinstance(head, bytes) and b" " in head):
        return None
    if encoder.encoding != "utf-8" or encoder.encoding_errors != "strict":
        return None  # redis-py's defaults, which every client of client.py keeps
    try:
        # hiredis's stub types the tuple as of one item; it takes any number
        return [_hiredis_pack(args)]  # type: ignore[arg-type]
    except TypeError:  # not str, int, float or bytes: redis-py's packing or its DataError
        return None


class PackedConnection(Connection):
    def pack_command(self, *args: EncodableT) -> list[bytes]:
        return packed(self, args) or super().pack_command(*args)


# the same packing before redis-py's other connection classes (each a Connection)
class PackedSSLConnection(PackedConnection, SSLConnection):
    pass


class PackedSentinelConnection(PackedConnection, SentinelManagedConnection):
    pass


class PackedSentinelSSLConnection(PackedConnection, SentinelManagedSSLConnection):
    pass
