"""Commands packed into the Redis protocol by hiredis, as redis-py's sync client packs them,
and written without a task per command.

redis-py's asyncio connections pack a command in Python, joining each argument onto
the bytes packed so far (up to 6,000 of them before a new piece starts), so a command
with thousands of arguments copies kilobytes per argument. A worker's journal write for
one engine step of 128 sequences (a dozen or more arguments and an event each) took 3.4
to 9 ms to pack on a busy 2-core machine: 27 to 70 µs per streamed token. hiredis (a dependency,
through ``redis[hiredis]``) packs the same bytes in C, as redis-py's sync connections
already do when it is installed (``redis.connection.HiredisRespSerializer``): 2 to 3 µs
per sequence there.

redis-py's asyncio connection bounds each write by ``socket_timeout`` with
``asyncio.wait_for``, which on Python 3.11 runs the write in a new task: one task, its
scheduling and one more pass of the event loop per command. :class:`HiredisPacking`
writes in the caller's task and bounds the wait for the socket's buffer with a timer
(``asyncio.timeout``), which raises, disconnects and reports as redis-py does.

:func:`packing` gives a pool's connection class these two methods; every other
behaviour is redis-py's.
"""

from __future__ import annotations

import asyncio
from collections.abc import Iterable
from typing import Any, TypeVar

import hiredis
from redis.asyncio.connection import AbstractConnection
from redis.exceptions import ConnectionError as RedisConnectionError
from redis.exceptions import DataError
from redis.exceptions import TimeoutError as RedisTimeoutError

C = TypeVar("C", bound=type[AbstractConnection])


class HiredisPacking(AbstractConnection):
    """``pack_command`` by ``hiredis.pack_command``, ``send_packed_command`` without a
    task per command (a mixin for a connection class)."""

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

    async def send_packed_command(
        self, command: bytes | str | Iterable[bytes], check_health: bool = True
    ) -> None:
        if not self.is_connected:
            await self.connect_check_health(check_health=False)
        if check_health:
            await self.check_health()  # type: ignore[no-untyped-call]
        if isinstance(command, str):
            command = command.encode()
        if isinstance(command, bytes):
            command = [command]
        try:
            self._writer.writelines(command)  # type: ignore[union-attr]
            async with asyncio.timeout(self.socket_timeout):
                await self._writer.drain()  # type: ignore[union-attr]
        except TimeoutError:  # before OSError, its base class
            await self.disconnect(nowait=True)
            raise RedisTimeoutError("Timeout writing to socket") from None
        except OSError as exc:
            await self.disconnect(nowait=True)
            errno, message = ("UNKNOWN", exc.args[0]) if len(exc.args) == 1 else exc.args[:2]
            raise RedisConnectionError(
                f"Error {errno} while writing to socket. {message}."
            ) from exc
        except BaseException:
            await self.disconnect(nowait=True)  # a half-written command: the connection goes
            raise


def packing(connection_class: C) -> C:
    """``connection_class`` with :class:`HiredisPacking`'s ``pack_command``."""
    if issubclass(connection_class, HiredisPacking):
        return connection_class
    name = f"Hiredis{connection_class.__name__}"
    packed: C = type(name, (HiredisPacking, connection_class), {})  # type: ignore[assignment]
    return packed
