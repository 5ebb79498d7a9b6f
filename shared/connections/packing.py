"""Commands packed into the Redis protocol by hiredis, as redis-py's sync client packs them.

redis-py's asyncio connections pack a command in Python, joining each argument onto
the bytes packed so far (up to 6,000 of them before a new piece starts), so a command
with thousands of arguments copies kilobytes per argument. A worker's journal write for
one engine step of 128 sequences (a dozen or more arguments and an event each) took 3.4
to 9 ms to pack on a busy 2-core machine: 27 to 70 µs per streamed token. hiredis (a dependency,
through ``redis[hiredis]``) packs the same bytes in C, as redis-py's sync connections
already do when it is installed (``redis.connection.HiredisRespSerializer``): 2 to 3 µs
per sequence there.

:func:`packing` gives a pool's connection class this ``pack_command``; every other
behaviour is redis-py's.
"""

from __future__ import annotations

from typing import Any, TypeVar

import hiredis
from redis.asyncio.connection import AbstractConnection
from redis.exceptions import DataError

C = TypeVar("C", bound=type[AbstractConnection])


class HiredisPacking:
    """``pack_command`` by ``hiredis.pack_command`` (a mixin for a connection class)."""

    def pack_command(self, *args: Any) -> list[bytes]:
        first = args[0]
        if isinstance(first, str):  # 'CONFIG GET' is two arguments (as redis-py splits it)
            args = (*first.encode().split(), *args[1:])
        elif b" " in first:
            args = (*first.split(), *args[1:])
        try:
            return [hiredis.pack_command(args)]
        except TypeError:
            pass  # a bytearray (hiredis takes str, int, float, bytes, memoryview), or bad
        packed: Any = tuple(bytes(arg) if isinstance(arg, bytearray) else arg for arg in args)
        try:
            return [hiredis.pack_command(packed)]
        except TypeError as exc:  # what redis-py's encoder raises for such an argument
            raise DataError(str(exc)) from exc


def packing(connection_class: C) -> C:
    """``connection_class`` with :class:`HiredisPacking`'s ``pack_command``."""
    if issubclass(connection_class, HiredisPacking):
        return connection_class
    name = f"Hiredis{connection_class.__name__}"
    packed: C = type(name, (HiredisPacking, connection_class), {})  # type: ignore[assignment]
    return packed
