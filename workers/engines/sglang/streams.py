"""SGLang requests in flight: their rids, the tasks that read their streams, their aborts.

Aborts go through ``engine.tokenizer_manager.abort_request(rid=...)``. SGLang's
scheduler aborts every request whose rid *starts with* the given rid, so rids are
``"{job_id}#{random suffix}"`` (no rid is a prefix of another).

Cancelling the consumer must not cancel SGLang's ``generate_request`` generator: on
the way out it drops the rid from ``rid_to_state`` (``_discard_pending_req_states``),
after which ``abort_request`` ignores the rid and the request runs on in the
scheduler. So each stream is read by a separate pump task; the consumer's
cancellation stops at :meth:`RequestStreams.run`, ``abort_request`` goes out while
SGLang still holds the rid, and the pump drains the stream to SGLang's own abort
chunk (Dynamo's handlers do the same: abort from a monitor task, let the stream end
by itself).
"""

from __future__ import annotations

import asyncio
import logging
import uuid
from collections.abc import AsyncGenerator, Callable
from typing import Any, Final

from shared.errors import ConveyorError, EngineError, InvalidRequest
from workers.engines.base import StepOutput
from workers.engines.sglang.translate import StreamDecoder

log = logging.getLogger(__name__)

STREAM_DRAIN_TIMEOUT_S: Final = 30.0
"""How long an aborted request's stream may take to deliver SGLang's abort chunk."""

ABORT_RETRY_S: Final = 0.5
"""While an aborted stream has not ended, ``abort_request`` is repeated this often."""

IN_BAND_ERRORS: Final = (InvalidRequest, EngineError)
"""Raised by the decoder when SGLang ended a request with an error chunk."""

_END: Final = object()


class RequestStreams:
    """The requests one ``sglang.Engine`` is running for Conveyor, by job id."""

    def __init__(self, engine: Any, translate: Callable[[Exception], ConveyorError]) -> None:
        """``translate`` turns an exception out of ``async_generate`` into Conveyor's."""
        self._engine = engine
        self._translate = translate
        self._rids: dict[str, str] = {}
        self._aborting: set[str] = set()
        self._background: set[asyncio.Task[None]] = set()

    def __len__(self) -> int:
        return len(self._rids)

    async def run(
        self, job_id: str, request: dict[str, Any], decoder: StreamDecoder
    ) -> AsyncGenerator[StepOutput, None]:
        """One request (``async_generate`` keyword arguments but the rid), decoded."""
        rid = f"{job_id}#{uuid.uuid4().hex[:12]}"
        self._rids[job_id] = rid
        chunks: asyncio.Queue[Any] = asyncio.Queue()
        pump = asyncio.create_task(
            self._pump({**request, "rid": rid}, chunks), name=f"sglang-stream-{rid}"
        )
        finished = False
        try:
            while True:
                chunk = await chunks.get()
                if chunk is _END:
                    finished = True
                    log.warning("SGLang stream of %s ended without a finish reason", job_id)
                    return
                if isinstance(chunk, Exception):
                    finished = True  # the request never started or is gone
                    raise self._translate(chunk) from chunk
                step = decoder.step(chunk, abort_requested=job_id in self._aborting)
                if step is None:
                    continue
                finished = step.finish_reason is not None
                yield step
                if finished:
                    return
        except IN_BAND_ERRORS:
            finished = True  # an error chunk: SGLang has already finished the request
            raise
        finally:
            if self._rids.get(job_id) == rid:
                del self._rids[job_id]
            self._aborting.discard(job_id)
            if not finished:  # cancelled or closed early
                self._abort_rid(rid)
            self._reap(pump, None if finished else rid)

    def abort(self, job_id: str) -> None:
        """Ask SGLang to abort the job's request; its stream then ends with ``"abort"``."""
        rid = self._rids.get(job_id)
        if rid is None:
            return
        self._aborting.add(job_id)
        self._abort_rid(rid)

    async def _pump(self, kwargs: dict[str, Any], chunks: asyncio.Queue[Any]) -> None:
        try:
            stream = await self._engine.async_generate(**kwargs)
            async for chunk in stream:
                chunks.put_nowait(chunk)
        except Exception as exc:
            chunks.put_nowait(exc)
            return
        chunks.put_nowait(_END)

    def _abort_rid(self, rid: str) -> None:
        manager = getattr(self._engine, "tokenizer_manager", None)
        abort_request = getattr(manager, "abort_request", None)
        if not callable(abort_request):
            log.warning("cannot abort %s: the engine has no tokenizer_manager.abort_request", rid)
            return
        try:
            abort_request(rid=rid, abort_all=False)
        except Exception:
            log.exception("SGLang abort_request(%s) failed", rid)

    def _reap(self, pump: asyncio.Task[None], aborted_rid: str | None) -> None:
        """Let the pump finish in the background (bounded), without holding the consumer."""
        if pump.done():
            return
        reaper = asyncio.create_task(self._drain(pump, aborted_rid))
        self._background.add(reaper)
        reaper.add_done_callback(self._background.discard)

    async def _drain(self, pump: asyncio.Task[None], aborted_rid: str | None) -> None:
        """Wait for SGLang to end an aborted stream, repeating the abort meanwhile.

        ``abort_request`` is dropped while SGLang does not hold the rid yet (older
        releases register it only after tokenizing), so it is sent again until the
        stream ends. Past the deadline the stream is closed regardless.
        """
        loop = asyncio.get_running_loop()
        deadline = loop.time() + STREAM_DRAIN_TIMEOUT_S
        while True:
            done, _ = await asyncio.wait({pump}, timeout=ABORT_RETRY_S)
            if done:
                return
            if loop.time() >= deadline:
                log.warning(
                    "SGLang stream %s did not end %.0fs after its abort; closing it",
                    aborted_rid,
                    STREAM_DRAIN_TIMEOUT_S,
                )
                pump.cancel()
                await asyncio.wait({pump})
                return
            if aborted_rid is not None:
                self._abort_rid(aborted_rid)
