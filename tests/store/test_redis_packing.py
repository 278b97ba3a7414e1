"""Redis commands packed by hiredis in one call (store/redis/packing.py): the same bytes on
the wire as redis-py's own packing, redis-py's way for what hiredis does not take, and the
packing connections in use on every kind of Redis URL."""

from collections.abc import Sequence

import pytest
from hypothesis import given
from hypothesis import strategies as st
from redis.asyncio.connection import Connection
from redis.exceptions import DataError

from fairlimit.store import open_store
from fairlimit.store.redis import RedisStore
from fairlimit.store.redis.packing import PackedConnection
from redis_servers import RedisClusterProcesses, RedisProcess, suite_url

_ARG = st.one_of(
    st.text(),  # any code point but lone surrogates, which neither packs (UTF-8, strict)
    st.integers(min_value=-(2**63), max_value=2**64),
    st.floats(allow_nan=True, allow_infinity=True),
    st.binary(),
)


def _wire(connection: Connection, args: Sequence[object]) -> bytes:
    return b"".join(connection.pack_command(*args))  # type: ignore[arg-type]


@pytest.mark.unit
@given(st.sampled_from(["EVALSHA", "HMGET", b"PING"]), st.lists(_ARG, max_size=60))
def test_the_same_bytes_as_redis_py(head: str | bytes, args: list[object]) -> None:
    """Every str, int, float and bytes argument list packs to redis-py's bytes."""
    packed, stock = PackedConnection(), Connection()
    assert _wire(packed, [head, *args]) == _wire(stock, [head, *args])


@pytest.mark.unit
@pytest.mark.parametrize(
    ("args", "wire"),
    [
        # a name with a space: redis-py sends it as two arguments
        (("CONFIG GET", "x"), b"*3\r\n$6\r\nCONFIG\r\n$3\r\nGET\r\n$1\r\nx\r\n"),
        ((b"CONFIG GET", "x"), b"*3\r\n$6\r\nCONFIG\r\n$3\r\nGET\r\n$1\r\nx\r\n"),
        (("SET", "k", memoryview(b"v")), b"*3\r\n$3\r\nSET\r\n$1\r\nk\r\n$1\r\nv\r\n"),
        (("SET", "k", bytearray(b"v")), b"*3\r\n$3\r\nSET\r\n$1\r\nk\r\n$1\r\nv\r\n"),
    ],
    ids=["str name with a space", "bytes name with a space", "memoryview", "bytearray"],
)
def test_what_hiredis_does_not_take_goes_redis_pys_way(
    args: tuple[object, ...], wire: bytes
) -> None:
    assert _wire(PackedConnection(), args) == _wire(Connection(), args) == wire


@pytest.mark.unit
@pytest.mark.parametrize("value", [True, None, [1], object()])
def test_what_redis_py_refuses_is_refused_as_before(value: object) -> None:
    with pytest.raises(DataError):
        PackedConnection().pack_command("SET", "k", value)  # type: ignore[arg-type]


@pytest.mark.unit
def test_another_encoding_goes_redis_pys_way() -> None:
    """hiredis packs str as UTF-8: a connection told otherwise keeps redis-py's packing."""
    latin = PackedConnection(encoding="latin-1")
    assert _wire(latin, ["SET", "k", "é"]) == b"*3\r\n$3\r\nSET\r\n$1\r\nk\r\n$1\r\n\xe9\r\n"


@pytest.mark.behaviour
async def test_a_standalone_store_talks_through_packing_connections(
    redis_server: RedisProcess,
) -> None:
    store = open_store(suite_url(redis_server.url))
    assert isinstance(store, RedisStore)
    try:
        await store.ping()
        pool = store._client.connection_pool  # type: ignore[union-attr]
        assert issubclass(pool.connection_class, PackedConnection)
    finally:
        await store.close()


@pytest.mark.behaviour
async def test_every_node_of_a_cluster_talks_through_packing_connections(
    redis_cluster: RedisClusterProcesses,
) -> None:
    """RedisCluster takes no connection class: the nodes it finds are made from its
    connection keyword arguments, which client.py sets."""
    store = open_store(suite_url(redis_cluster.url))
    assert isinstance(store, RedisStore)
    try:
        await store.ping()
        nodes = store._client.get_nodes()  # type: ignore[union-attr]
        assert len(nodes) == 3
        assert all(issubclass(n.connection_class, PackedConnection) for n in nodes), [
            n.connection_class for n in nodes
        ]
    finally:
        await store.close()
