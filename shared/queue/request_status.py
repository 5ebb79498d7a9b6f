"""Where a request is now, readable by any gateway: ``GET /v1/requests/{id}``.

Nothing is written per token. What the answer is built from:

1. the request's status record (``names.request_status``), a hash the admission script
   writes in the step that queues the jobs: its open record (key, model, sequences,
   admission time), its gateway, its job stream and its first job's entry id;
2. the run journal's hash of each job run (``names.job_run``): the worker holding it
   (``owner``), when that run began (``began_ms``) and how many runs it took (``starts``);
3. the request's sent tally (``names.sent_tally``): first token, finished sequences;
4. when the request ends, its gateway adds its outcome (``f``) to the record in the
   MULTI that closes it (:func:`shared.queue.open_requests.finish_note_of`), and the
   record lives ``STATUS_FINISHED_TTL_S`` more.

While a job waits, its position is counted from its stream: entries before it that no
worker took yet.
"""

from __future__ import annotations

import time
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any, Final

import redis.asyncio as aioredis

from shared.connections.connect import as_text
from shared.errors import ProtocolError
from shared.queue import names
from shared.queue.open_requests import OpenRequest, SentTally, decode_open
from shared.roles import Role

STATUS_MARGIN_S: Final = 600
"""The record outlives the request's deadline by this much."""
MAX_SEQUENCES_SHOWN: Final = 16
MAX_POSITION_SCAN: Final = 10_000
"""A position deeper than this is reported as this (the count reads the stream)."""
STAGES: Final = (Role.ENCODE, Role.PREFILL, Role.DECODE, Role.AGGREGATED, Role.EMBED)
"""In the order a request passes them: the last one with a run is where it is."""


def status_ttl_s(deadline_unix: float) -> int:
    return max(1, int(deadline_unix - time.time())) + STATUS_MARGIN_S


@dataclass(frozen=True, slots=True)
class SequenceRun:
    """One sequence's latest run (a job of the request)."""

    index: int
    stage: str
    worker: str | None
    """The worker running it now (None: between stages, or done)."""
    began_unix: float | None
    runs: int


@dataclass(slots=True)
class RequestStatus:
    request_id: str
    opened: OpenRequest
    gateway_id: str
    stream: str
    entry_id: str
    state: str = "queued"
    """``queued``, ``running``, ``finished``."""
    position: int | None = None
    """While queued: 1 = the next job a worker takes from its stream."""
    eta_s: float | None = None
    sequences: list[SequenceRun] = field(default_factory=list)
    first_token_unix: float | None = None
    finished_unix: float | None = None
    outcome: str | None = None
    """A finished request's usage status (``completed``, ``cancelled``, ``failed``)."""
    finish_reason: str | None = None
    migrations: int = 0

    @property
    def key_id(self) -> str | None:
        return self.opened.key_id

    def as_json(self) -> dict[str, Any]:
        return {
            "id": self.request_id,
            "object": "request.status",
            "model": self.opened.model,
            "state": self.state,
            "queue": {"stream": self.stream, "position": self.position, "eta_s": self.eta_s},
            "sequences": [
                {
                    "index": run.index,
                    "stage": run.stage,
                    "worker": run.worker,
                    "started_at": run.began_unix,
                    "runs": run.runs,
                }
                for run in self.sequences
            ],
            "migrations": self.migrations,
            "finish_reason": self.finish_reason,
            "outcome": self.outcome,
            "timestamps": {
                "received_at": self.opened.received_unix,
                "started_at": min(
                    (r.began_unix for r in self.sequences if r.began_unix is not None),
                    default=None,
                ),
                "first_token_at": self.first_token_unix,
                "finished_at": self.finished_unix,
            },
        }


async def read_status(redis: aioredis.Redis, request_id: str) -> RequestStatus | None:
    """The request's status (None: this Redis knows no such request, or it expired)."""
    async with redis.pipeline(transaction=False) as pipe:
        pipe.hgetall(names.request_status(request_id))
        pipe.hgetall(names.sent_tally(request_id))
        record, sent = await pipe.execute()
    status = _from_record(request_id, record)
    if status is None:
        return None
    if b"f" in record:
        _finished(status, as_text(record[b"f"]))
        return status
    tally = SentTally.from_hash(sent)
    status.first_token_unix = tally.first_token_unix
    await _runs(redis, status)
    if not status.sequences:
        status.position = await _position(redis, status.stream, status.entry_id)
        status.state = "queued" if status.position is not None else "running"
    else:
        status.state = "running"
    return status


def _from_record(request_id: str, record: Mapping[bytes, bytes]) -> RequestStatus | None:
    if b"o" not in record:
        return None
    try:
        opened = decode_open(record[b"o"])
    except ProtocolError:
        return None
    return RequestStatus(
        request_id=request_id,
        opened=opened,
        gateway_id=as_text(record.get(b"g", b"")),
        stream=as_text(record.get(b"s", b"")),
        entry_id=as_text(record.get(b"e", b"")),
    )


def _finished(status: RequestStatus, value: str) -> None:
    outcome, reason, finished, first, migrations = value.split("|")
    status.state = "finished"
    status.outcome = outcome
    status.finish_reason = reason or None
    status.finished_unix = float(finished)
    status.first_token_unix = float(first) if first else None
    status.migrations = int(migrations)


async def _runs(redis: aioredis.Redis, status: RequestStatus) -> None:
    """Each sequence's latest stage with a run, from the run journal."""
    shown = min(status.opened.n, MAX_SEQUENCES_SHOWN)
    async with redis.pipeline(transaction=False) as pipe:
        for index in range(shown):
            for stage in STAGES:
                pipe.hgetall(names.job_run(f"{status.request_id}/{index}", stage))
        replies = await pipe.execute()
    for index in range(shown):
        runs = replies[index * len(STAGES) : (index + 1) * len(STAGES)]
        latest = [(stage, run) for stage, run in zip(STAGES, runs, strict=True) if run]
        if latest:
            stage, run = latest[-1]
            status.sequences.append(_run(index, stage, run))
    status.migrations = max((r.runs - 1 for r in status.sequences), default=0)


def _run(index: int, stage: Role, run: Mapping[bytes, bytes]) -> SequenceRun:
    owner = run.get(b"owner")
    began = run.get(b"began_ms")
    return SequenceRun(
        index=index,
        stage=stage.value,
        worker=as_text(owner).rpartition("/")[0] if owner else None,
        began_unix=int(began) / 1000 if began else None,
        runs=int(run.get(b"starts", b"1")),
    )


async def _position(redis: aioredis.Redis, stream: str, entry_id: str) -> int | None:
    """1 + the jobs ahead of ``entry_id`` no worker took yet; None: a worker took it (or
    it is gone)."""
    if not stream or not entry_id:
        return None
    waiting = await waiting_entries(redis, stream, until=entry_id)
    key = entry_key(entry_id)
    if not waiting or waiting[-1] != key:
        return None  # delivered to a worker (that has not begun its run yet), or gone
    return len(waiting)


async def waiting_entries(
    redis: aioredis.Redis, stream: str, *, until: str = "+"
) -> list[tuple[int, int]]:
    """The ids of ``stream``'s entries no worker took yet, oldest first (up to ``until``,
    at most :data:`MAX_POSITION_SCAN`)."""
    groups: Any = await redis.xinfo_groups(stream) if await redis.exists(stream) else []
    last = next(
        (as_text(g["last-delivered-id"]) for g in groups if as_text(g["name"]) == names.JOB_GROUP),
        "0-0",
    )
    entries: Any = await redis.xrange(stream, f"({last}", until, count=MAX_POSITION_SCAN)
    return [entry_key(as_text(entry)) for entry, _ in entries]


def entry_key(entry_id: str) -> tuple[int, int]:
    ms, _, seq = entry_id.partition("-")
    return int(ms), int(seq or 0)
