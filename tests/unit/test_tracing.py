"""Trace context and the worker's run spans, in process (a recording fake tracer)."""

from __future__ import annotations

from dataclasses import dataclass

import pytest

from shared.protocol import EmbedJob, GenerateJob, SamplingOptions
from shared.queue.job_queue import Delivery
from shared.roles import Role
from shared.tracing.spans import Attributes, Tracer
from shared.tracing.traceparent import TraceParent, parse
from shared.tracing.tracer import build_tracer, traces_url
from workers.intake.run_trace import RunEnd, RunTimes, RunTracer, entry_unix
from workers.journal.run_journal import RunLease

PARENT = TraceParent(0x0AF7651916CD43DD8448EB211C80319C, 0xB7AD6B7169203331, sampled=True)


def test_a_traceparent_round_trips() -> None:
    assert parse(PARENT.header) == PARENT
    assert PARENT.header == "00-0af7651916cd43dd8448eb211c80319c-b7ad6b7169203331-01"
    assert parse(PARENT.header.upper()) == PARENT
    assert parse("01-0af7651916cd43dd8448eb211c80319c-b7ad6b7169203331-00-later") == TraceParent(
        PARENT.trace_id, PARENT.span_id, sampled=False
    )


@pytest.mark.parametrize(
    "value",
    [
        None,
        "",
        "garbage",
        "00-00000000000000000000000000000000-b7ad6b7169203331-01",  # zero trace id
        "00-0af7651916cd43dd8448eb211c80319c-0000000000000000-01",  # zero span id
        "ff-0af7651916cd43dd8448eb211c80319c-b7ad6b7169203331-01",  # forbidden version
        "00-0af7651916cd43dd8448eb211c80319c-b7ad6b7169203331-01-extra",  # v00 is exact
        "00-0af7651916cd43dd8448eb211c80319-b7ad6b7169203331-01",  # short
    ],
)
def test_an_invalid_traceparent_starts_a_new_trace(value: str | None) -> None:
    assert parse(value) is None


def test_where_spans_go(monkeypatch: pytest.MonkeyPatch) -> None:
    for name in ("OTEL_EXPORTER_OTLP_ENDPOINT", "OTEL_EXPORTER_OTLP_TRACES_ENDPOINT"):
        monkeypatch.delenv(name, raising=False)
    assert traces_url(None) is None
    assert not build_tracer(None, 1.0, "conveyor-gateway", "gw").enabled
    assert traces_url("http://collector:4318/") == "http://collector:4318/v1/traces"
    assert traces_url("http://collector:4318/v1/traces") == "http://collector:4318/v1/traces"
    monkeypatch.setenv("OTEL_EXPORTER_OTLP_ENDPOINT", "http://otel:4318")
    assert traces_url(None) == "http://otel:4318/v1/traces"
    assert traces_url("http://mine:4318") == "http://mine:4318/v1/traces"  # ours wins
    monkeypatch.setenv("OTEL_EXPORTER_OTLP_TRACES_ENDPOINT", "http://otel:4318/custom")
    assert traces_url(None) == "http://otel:4318/custom"  # used as is, as the standard says


@dataclass
class Recorded:
    name: str
    parent: TraceParent
    start: float
    end: float
    failed: str | None


class RecordingTracer(Tracer):
    enabled = True

    def __init__(self) -> None:
        self.spans: list[Recorded] = []

    def record(
        self,
        name: str,
        parent: TraceParent,
        start_unix: float,
        end_unix: float,
        attributes: Attributes | None = None,
        *,
        failed: str | None = None,
    ) -> TraceParent | None:
        self.spans.append(Recorded(name, parent, start_unix, end_unix, failed))
        return TraceParent(parent.trace_id, len(self.spans), sampled=True)


def lease(
    role: Role,
    *,
    handoff: bool = False,
    emitted: list[int] | None = None,
    traceparent: str | None = PARENT.header,
    first_seq_unix: float | None = 1005.0,
) -> RunLease:
    job = GenerateJob(
        request_id="chatcmpl-1",
        index=0,
        model="tiny",
        prompt_token_ids=[1, 2],
        sampling=SamplingOptions(max_tokens=4),
        reply_to="conveyor:reply:gw",
        deadline_unix=2000.0,
        created_unix=999.0,
        handoff={"remote": "kv"} if handoff else None,
        traceparent=traceparent,
    )
    delivery = Delivery("conveyor:jobs:tiny:" + role.value, "1000000-0", job, role)
    return RunLease(delivery, "fence", 0, 0, emitted or [], first_seq_unix=first_seq_unix)


def spans_of(run: RunLease, end: RunEnd = RunEnd.DONE) -> list[tuple[str, float, float]]:
    tracer = RecordingTracer()
    RunTracer(tracer, "worker-1").finished(run, RunTimes(1001.0, 1010.0, end))
    return [(span.name, span.start, span.end) for span in tracer.spans]


def test_an_aggregated_run_is_a_prefill_then_a_decode() -> None:
    assert entry_unix("1000000-0") == 1000.0
    assert spans_of(lease(Role.AGGREGATED)) == [
        ("queue wait", 1000.0, 1001.0),
        ("aggregated run", 1001.0, 1010.0),
        ("prefill", 1001.0, 1005.0),
        ("decode", 1005.0, 1010.0),
    ]


def test_a_decode_run_pulls_the_kv_cache_first_unless_it_resumes() -> None:
    assert [name for name, *_ in spans_of(lease(Role.DECODE, handoff=True))][2:] == [
        "kv transfer",
        "decode",
    ]
    resumed = lease(Role.DECODE, handoff=True, emitted=[5, 6])  # recomputes its prompt
    assert [name for name, *_ in spans_of(resumed)][2:] == ["prefill", "decode"]


def test_one_stage_roles_and_runs_without_output() -> None:
    assert [name for name, *_ in spans_of(lease(Role.PREFILL))][1:] == ["prefill run", "prefill"]
    stopped = lease(Role.AGGREGATED, first_seq_unix=None)
    assert spans_of(stopped, RunEnd.HANDED_BACK)[2] == ("prefill", 1001.0, 1010.0)


def test_a_handed_back_run_is_marked_failed_and_a_cancelled_one_is_not() -> None:
    tracer = RecordingTracer()
    runs = RunTracer(tracer, "worker-1")
    runs.finished(lease(Role.AGGREGATED), RunTimes(1001.0, 1002.0, RunEnd.HANDED_BACK))
    runs.finished(lease(Role.AGGREGATED), RunTimes(1001.0, 1002.0, RunEnd.CANCELLED))
    failed = [span.failed for span in tracer.spans if span.name == "aggregated run"]
    assert failed == ["handed_back", None]


def test_untraced_or_unsampled_jobs_record_nothing() -> None:
    assert spans_of(lease(Role.AGGREGATED, traceparent=None)) == []
    unsampled = TraceParent(PARENT.trace_id, PARENT.span_id, sampled=False).header
    assert spans_of(lease(Role.AGGREGATED, traceparent=unsampled)) == []
    embed = EmbedJob(
        request_id="embd-1",
        index=0,
        model="e",
        prompt_token_ids=[1],
        reply_to="r",
        deadline_unix=2.0,
        created_unix=1.0,
    )
    assert embed.traceparent is None
