"""Tracing on the gateway: the client's ``traceparent`` (or a new trace) becomes the
request's server span, its jobs carry that span as their parent, the response names the
trace in ``X-Trace-Id``, and the spans reach an OTLP receiver; tracing off changes
nothing."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Iterator

import pytest

from shared.tracing.otlp import OtlpTracer
from shared.tracing.traceparent import parse
from tests.gateway.harness import BODIES, CHAT, EMBEDDINGS, LiveGateway
from tests.support.otlp_receiver import OtlpReceiver, otlp_receiver
from tests.waiting import eventually

CLIENT_TRACE = "0af7651916cd43dd8448eb211c80319c"
CLIENT_SPAN = "b7ad6b7169203331"


@pytest.fixture
def receiver() -> Iterator[OtlpReceiver]:
    with otlp_receiver() as running:
        yield running


@pytest.fixture
async def traced(gateway: LiveGateway, receiver: OtlpReceiver) -> AsyncIterator[LiveGateway]:
    tracer = OtlpTracer(f"{receiver.url}/v1/traces", 1.0, "conveyor-gateway", "gw-test")
    gateway.state.tracer = tracer
    yield gateway
    await asyncio.to_thread(tracer.shutdown)


async def test_the_client_trace_continues_through_the_jobs(
    traced: LiveGateway, receiver: OtlpReceiver
) -> None:
    response = await traced.client.post(
        CHAT,
        json={**BODIES[CHAT], "max_tokens": 2},
        headers={"traceparent": f"00-{CLIENT_TRACE}-{CLIENT_SPAN}-01"},
    )
    assert response.status_code == 200, response.text
    assert response.headers["x-trace-id"] == CLIENT_TRACE
    job = traced.workers[0].jobs[-1]
    carried = parse(job.traceparent)
    assert carried is not None and carried.trace_hex == CLIENT_TRACE and carried.sampled
    await asyncio.to_thread(traced.state.tracer.shutdown)  # flushes

    async def three_spans() -> bool:
        return len(receiver.trace(CLIENT_TRACE)) == 3

    await eventually(three_spans, what="the request's spans at the receiver")
    spans = {span.name: span for span in receiver.trace(CLIENT_TRACE)}
    server = spans["POST /v1/chat/completions"]
    assert server.parent_span_id == CLIENT_SPAN
    assert server.span_id == f"{carried.span_id:016x}"  # the jobs' parent
    assert server.attributes["http.response.status_code"] == 200
    assert server.service == "conveyor-gateway"
    for stage in ("admission", "delivery"):
        assert spans[stage].parent_span_id == server.span_id
        assert server.start_ns <= spans[stage].start_ns <= spans[stage].end_ns <= server.end_ns
    assert spans["admission"].end_ns <= spans["delivery"].start_ns


async def test_without_a_traceparent_a_new_trace_starts(traced: LiveGateway) -> None:
    response = await traced.client.post(EMBEDDINGS, json=BODIES[EMBEDDINGS])
    assert response.status_code == 200, response.text
    trace_id = response.headers["x-trace-id"]
    assert len(trace_id) == 32 and int(trace_id, 16) != 0
    carried = parse(traced.workers[1].jobs[-1].traceparent)
    assert carried is not None and carried.trace_hex == trace_id


async def test_an_unsampled_client_trace_records_nothing(
    traced: LiveGateway, receiver: OtlpReceiver
) -> None:
    response = await traced.client.post(
        CHAT,
        json={**BODIES[CHAT], "max_tokens": 1},
        headers={"traceparent": f"00-{CLIENT_TRACE}-{CLIENT_SPAN}-00"},
    )
    assert response.headers["x-trace-id"] == CLIENT_TRACE
    carried = parse(traced.workers[0].jobs[-1].traceparent)
    assert carried is not None and not carried.sampled  # the workers record nothing either
    await asyncio.to_thread(traced.state.tracer.shutdown)
    assert receiver.trace(CLIENT_TRACE) == []


async def test_tracing_off_adds_nothing(gateway: LiveGateway) -> None:
    response = await gateway.client.post(
        CHAT,
        json={**BODIES[CHAT], "max_tokens": 1},
        headers={"traceparent": f"00-{CLIENT_TRACE}-{CLIENT_SPAN}-01"},
    )
    assert response.status_code == 200
    assert "x-trace-id" not in response.headers
    assert gateway.workers[0].jobs[-1].traceparent is None
