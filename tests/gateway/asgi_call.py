"""One HTTP request driven straight through an ASGI app, as uvicorn drives it.

``httpx.ASGITransport`` collects the whole response before returning, and tells the
app the client left only once the response is complete. An :class:`AsgiCall` hands
the test each body chunk as the app sends it and lets the client leave at a moment
the test chooses (ASGI spec 2.3, like uvicorn: the app learns it from ``receive``).
"""

from __future__ import annotations

import asyncio
import json
from types import TracebackType
from typing import Any, Self

from fastapi import FastAPI
from starlette.types import Message

from shared.tasks import cancel_and_wait

CHUNK_WAIT_S = 5.0


class AsgiCall:
    def __init__(self, app: FastAPI, path: str, body: dict[str, Any], headers: dict[str, str]):
        self._app = app
        self._body = json.dumps(body).encode()
        self._scope: dict[str, Any] = {
            "type": "http",
            "asgi": {"version": "3.0", "spec_version": "2.3"},
            "http_version": "1.1",
            "method": "POST",
            "scheme": "http",
            "path": path,
            "raw_path": path.encode(),
            "query_string": b"",
            "root_path": "",
            "headers": [
                (b"host", b"gw"),
                (b"content-type", b"application/json"),
                (b"content-length", str(len(self._body)).encode()),
                *((k.lower().encode(), v.encode()) for k, v in headers.items()),
            ],
            "client": ("127.0.0.1", 50000),
            "server": ("gw", 80),
        }
        self._sent: asyncio.Queue[Message] = asyncio.Queue()
        self._left = asyncio.Event()
        self._body_read = False
        self._task: asyncio.Task[None] | None = None
        self.status: int | None = None
        self.headers: dict[str, str] = {}
        self.received = b""

    async def __aenter__(self) -> Self:
        self._task = asyncio.create_task(self._app(self._scope, self._receive, self._send))
        return self

    async def __aexit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        traceback: TracebackType | None,
    ) -> None:
        if self._task is not None:
            await cancel_and_wait([self._task])

    async def _receive(self) -> Message:
        if not self._body_read:
            self._body_read = True
            return {"type": "http.request", "body": self._body, "more_body": False}
        await self._left.wait()
        return {"type": "http.disconnect"}

    async def _send(self, message: Message) -> None:
        await self._sent.put(message)

    async def _next_message(self) -> Message | None:
        """The app's next message; None once the app has returned and sent everything."""
        assert self._task is not None, "use the call in `async with`"
        getter = asyncio.ensure_future(self._sent.get())
        await asyncio.wait(
            {getter, self._task}, timeout=CHUNK_WAIT_S, return_when=asyncio.FIRST_COMPLETED
        )
        if getter.done():
            return getter.result()
        getter.cancel()
        if self._task.done():
            self._task.result()  # re-raise what the app died of
            return None
        raise TimeoutError(f"the app sent nothing for {CHUNK_WAIT_S}s")

    async def start(self) -> int:
        """Wait for the response's status line and headers."""
        message = await self._next_message()
        assert message is not None and message["type"] == "http.response.start", message
        self.status = int(message["status"])
        self.headers = {k.decode(): v.decode() for k, v in message["headers"]}
        return self.status

    async def chunk(self) -> bytes | None:
        """The next body chunk as sent; None at the end of the body."""
        message = await self._next_message()
        if message is None or (not message.get("more_body", False) and not message["body"]):
            return None
        data: bytes = message["body"]
        self.received += data
        return data

    async def read_until(self, marker: str) -> str:
        """Body chunks until what was received holds ``marker``."""
        while marker.encode() not in self.received:
            if await self.chunk() is None:
                raise AssertionError(f"the body ended without {marker!r}: {self.received!r}")
        return self.received.decode()

    async def read_all(self) -> str:
        while await self.chunk() is not None:
            pass
        return self.received.decode()

    def leave(self) -> None:
        """The client disconnects."""
        self._left.set()

    async def finished(self) -> None:
        """Wait until the app has returned."""
        assert self._task is not None
        await asyncio.wait_for(asyncio.shield(self._task), CHUNK_WAIT_S)


class SlowBodyCall(AsgiCall):
    """A client that sends ten bytes of its body, then nothing more (it never leaves);
    ``receive_calls`` counts how often the app asked for body."""

    receive_calls = 0

    async def _receive(self) -> Message:
        self.receive_calls += 1
        if self.receive_calls == 1:
            return {"type": "http.request", "body": self._body[:10], "more_body": True}
        await asyncio.Event().wait()
        raise AssertionError("unreachable")
