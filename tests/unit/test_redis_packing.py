"""Commands packed by hiredis are byte for byte what redis-py packs, and refuse what
redis-py refuses; a client from ``connect`` runs scripts and pipelines with them, and
writes each command in the caller's task, within ``socket_timeout``."""

from __future__ import annotations

import asyncio
import socket
from typing import Any

import pytest
from redis.asyncio.connection import Connection, UnixDomainSocketConnection
from redis.exceptions import DataError
from redis.exceptions import TimeoutError as RedisTimeoutError

from shared.connections.connect import connect
from shared.connections.packing import HiredisPacking, packing
from tests.conftest import REAL_REDIS_URL, _require_real_redis

EVENT = b"\x99\xa3tok\xa1r\x00\x11\x00\x91\xcd\x04\xd2\xa4 tok\xc0\xc0"
COMMANDS: list[tuple[Any, ...]] = [
    ("GET", "k"),
    ("SET", "name:é", "välue", "PX", 1000),
    ("CONFIG GET", "maxmemory"),
    (b"CONFIG SET", b"x", b"y"),
    ("XADD", "s", "*", "v", b"1", "e", EVENT, "f", 2.5, "n", -(2**70)),
    ("ZADD", "z", 0.1, "a", 1e20, "b", 1 / 3, "c", -0.0, "d", float("inf"), "e", 1e-7, "f"),
    ("EVALSHA", "a" * 40, 0, *(["run:1", 17, b"\x01\x00\x00\x00", "", EVENT] * 500)),
    ("SET", "big", b"x" * 20_000),
    ("SET", "views", memoryview(b"abc"), bytearray(b"def")),
]


@pytest.mark.parametrize("command", COMMANDS, ids=lambda c: str(c[0]))
def test_the_same_bytes_as_redis_py(command: tuple[Any, ...]) -> None:
    theirs = b"".join(bytes(piece) for piece in Connection().pack_command(*command))
    ours = b"".join(packing(Connection)().pack_command(*command))
    assert ours == theirs


@pytest.mark.parametrize("bad", [True, None, object()])
def test_what_redis_py_refuses_is_refused(bad: object) -> None:
    with pytest.raises(DataError):
        Connection().pack_command("SET", "k", bad)
    with pytest.raises(DataError):
        packing(Connection)().pack_command("SET", "k", bad)


def test_any_connection_class_gets_it_once() -> None:
    unix = packing(UnixDomainSocketConnection)
    assert issubclass(unix, UnixDomainSocketConnection) and issubclass(unix, HiredisPacking)
    assert packing(unix) is unix


@pytest.mark.redis
async def test_a_connected_client_runs_scripts_and_pipelines() -> None:
    _require_real_redis(REAL_REDIS_URL)
    client = connect(REAL_REDIS_URL)
    try:
        script = client.register_script("return {#ARGV, ARGV[#ARGV]}")
        values = [f"v{i}" for i in range(3000)]
        assert await script(args=values) == [3000, b"v2999"]
        async with client.pipeline(transaction=False) as pipe:
            pipe.set("conveyor:test:packing", "é")
            pipe.get("conveyor:test:packing")
            pipe.delete("conveyor:test:packing")
            assert await pipe.execute() == [True, "é".encode(), 1]
    finally:
        await client.aclose()


@pytest.mark.redis
async def test_a_command_is_written_in_the_callers_task() -> None:
    """No task per command: redis-py's ``asyncio.wait_for`` around each write made one."""
    _require_real_redis(REAL_REDIS_URL)
    client = connect(REAL_REDIS_URL)
    loop = asyncio.get_running_loop()
    made: list[object] = []

    def counting(loop: asyncio.AbstractEventLoop, coro: Any, **kwargs: Any) -> asyncio.Task[Any]:
        made.append(coro)
        return asyncio.Task(coro, loop=loop, **kwargs)

    try:
        await client.get("conveyor:test:packing")  # connected, health-checked
        loop.set_task_factory(counting)
        for _ in range(5):
            await client.get("conveyor:test:packing")
        assert made == []
    finally:
        loop.set_task_factory(None)
        await client.aclose()


async def test_a_write_the_server_does_not_take_times_out_and_drops_the_connection() -> None:
    silent = socket.create_server(("127.0.0.1", 0))  # accepts (backlog), never reads
    port = silent.getsockname()[1]
    connection = packing(Connection)(
        host="127.0.0.1",
        port=port,
        socket_timeout=0.3,
        protocol=2,
        lib_name=None,
        lib_version=None,
    )
    try:
        await connection.connect()
        with pytest.raises(RedisTimeoutError, match="Timeout writing to socket"):
            await connection.send_packed_command([b"x" * (64 << 20)], check_health=False)
        assert not connection.is_connected
    finally:
        await connection.disconnect()
        silent.close()
