"""A job run's spans, recorded when the run ends (tracing on, and the job carries a
sampled ``traceparent``: shared/tracing).

Under the request's gateway span, each run of a job adds:

- ``queue wait``: from the job entering the stream it was read from to this run's start;
- ``<role> run`` (``aggregated run``, ``decode run``, ...): the whole run on this worker,
  with its attempt (a migrated run counts 1, 2, ...), the tokens it resumed after, and
  how it ended; and under it the stages it went through, split at its first output:
  ``prefill`` then ``decode`` (aggregated), ``kv transfer`` then ``decode`` (a decode
  run that pulls a prefilled KV cache), or one ``prefill``, ``encode`` or ``embed``.

A run on another worker after a migration records its own spans in the same trace, so
the trace shows both runs, each on the worker that did it.
"""

from __future__ import annotations

from dataclasses import dataclass
from enum import StrEnum

from shared.protocol import GenerateJob
from shared.roles import Role
from shared.tracing.spans import Tracer
from shared.tracing.traceparent import TraceParent, parse
from workers.journal.run_journal import RunLease


class RunEnd(StrEnum):
    DONE = "done"
    CANCELLED = "cancelled"
    FENCED = "fenced"
    HANDED_BACK = "handed_back"
    ENGINE_DEAD = "engine_dead"
    CRASHED = "crashed"


@dataclass(frozen=True, slots=True)
class RunTimes:
    started_unix: float
    ended_unix: float
    end: RunEnd


def entry_unix(entry_id: str) -> float:
    """When a stream entry was added (its id's milliseconds)."""
    return int(entry_id.partition("-")[0]) / 1000


def stages(lease: RunLease) -> tuple[str, str | None]:
    """The run's stage before its first output, and after it (None: one stage)."""
    job, role = lease.delivery.job, lease.delivery.role
    if role in (Role.ENCODE, Role.PREFILL, Role.EMBED):
        return role.value, None
    pulls_kv = isinstance(job, GenerateJob) and job.handoff is not None and not lease.emitted
    return ("kv transfer" if pulls_kv else "prefill"), "decode"


class RunTracer:
    """Records each finished run's spans on the worker's tracer."""

    def __init__(self, tracer: Tracer, worker_id: str) -> None:
        self._tracer = tracer
        self._worker_id = worker_id

    def finished(self, lease: RunLease, times: RunTimes) -> None:
        if not self._tracer.enabled:
            return
        parent = parse(lease.delivery.job.traceparent)
        if parent is None or not parent.sampled:
            return
        self._tracer.record(
            "queue wait", parent, entry_unix(lease.delivery.entry_id), times.started_unix
        )
        run = self._tracer.record(
            f"{lease.delivery.role.value} run",
            parent,
            times.started_unix,
            times.ended_unix,
            {
                "conveyor.job_id": lease.job_id,
                "conveyor.worker": self._worker_id,
                "conveyor.attempt": lease.attempt,
                "conveyor.resumed_tokens": len(lease.emitted),
                "conveyor.run_end": times.end.value,
            },
            failed=None if times.end in (RunEnd.DONE, RunEnd.CANCELLED) else times.end.value,
        )
        if run is not None:
            self._stages(lease, times, run)

    def _stages(self, lease: RunLease, times: RunTimes, run: TraceParent) -> None:
        before, after = stages(lease)
        first = lease.first_seq_unix
        if after is None or first is None:
            self._tracer.record(before, run, times.started_unix, times.ended_unix)
            return
        self._tracer.record(before, run, times.started_unix, first)
        self._tracer.record(after, run, first, times.ended_unix)
