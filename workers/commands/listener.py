"""Client cancels: the command channel's :class:`CancelCommand` stops the request's jobs here
(its :class:`WorkerCommand` messages, admin commands, go to :mod:`workers.commands.admin`).

The gateway sets a cancel flag and publishes the command once. A job already
running is cancelled (its engine request aborted); the request id is also kept
for a minute (:class:`RecentCancels`), for a job whose lease was in flight when
the command landed: the consumer checks it just before starting the job.
"""

from __future__ import annotations

import contextlib
import logging
from collections.abc import Callable

import redis.asyncio as aioredis
from redis.exceptions import RedisError

from shared.connections.connect import db_of
from shared.connections.retry import Backoff
from shared.errors import ProtocolError
from shared.protocol import CancelCommand, WorkerCommand, decode_bytes
from shared.queue import names
from workers.intake.recent_cancels import RecentCancels

log = logging.getLogger(__name__)

RESUBSCRIBE_S = 0.5
POLL_S = 1.0


class CommandListener:
    def __init__(
        self,
        redis: aioredis.Redis,
        *,
        recent: RecentCancels,
        cancel_request: Callable[[str], int],
        on_command: Callable[[WorkerCommand], None] | None = None,
    ) -> None:
        self._redis = redis
        self._recent = recent
        self._cancel_request = cancel_request
        self._on_command = on_command

    async def run(self) -> None:
        backoff = Backoff(RESUBSCRIBE_S, RESUBSCRIBE_S)
        while True:
            pubsub = self._redis.pubsub(ignore_subscribe_messages=True)
            try:
                await pubsub.subscribe(names.command_channel(db_of(self._redis)))
                while True:
                    message = await pubsub.get_message(timeout=POLL_S)
                    if message is not None:
                        self.handle(message["data"])
            except RedisError as exc:
                log.warning("command channel lost (%s); resubscribing", exc)
                await backoff.wait()
            finally:
                with contextlib.suppress(Exception):
                    await pubsub.aclose()  # type: ignore[no-untyped-call]

    def handle(self, data: bytes) -> None:
        """One command message: a cancel stops the request's jobs; an admin command goes to
        ``on_command``; anything else is ignored."""
        try:
            command = decode_bytes(data)
        except ProtocolError as exc:
            log.error("bad command message: %s", exc)
            return
        if isinstance(command, WorkerCommand):
            if self._on_command is not None:
                self._on_command(command)
            return
        if not isinstance(command, CancelCommand):
            return
        self._recent.add(command.request_id)
        if self._cancel_request(command.request_id):
            log.info("cancelled %s: client disconnected", command.request_id)
