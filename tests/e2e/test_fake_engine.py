"""The fake engine through the real serving path: a gateway and two `--engine fake`
workers, driven by the official ``openai`` client. No vLLM starts: this takes seconds."""

from __future__ import annotations

import os
import shutil
import subprocess
import time
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import httpx
import openai
import pytest
import redis
from openai.types.chat import ChatCompletionMessageParam
from prometheus_client.parser import text_string_to_metric_families

from tests.e2e.stack import Process, Stack, free_port, wait_until
from tests.support.otlp_receiver import OtlpReceiver, ReceivedSpan, otlp_receiver
from tests.waiting import eventually_sync

pytestmark = [pytest.mark.e2e, pytest.mark.redis]

FAKE_REDIS_URL = os.environ.get("CONVEYOR_TEST_FAKE_REDIS_URL", "redis://127.0.0.1:6379/5")
MESSAGES: list[ChatCompletionMessageParam] = [
    {"role": "user", "content": "hello from the fake engine"}
]


@pytest.fixture(scope="module")
def otlp() -> Iterator[OtlpReceiver]:
    """The stack's OTLP receiver: every process of the fake stack traces to it."""
    with otlp_receiver() as receiver:
        yield receiver


def traced(otlp: OtlpReceiver) -> dict[str, str]:
    """A process's tracing settings (spans exported every 100 ms, not every 5 s)."""
    return {"CONVEYOR_OTLP_ENDPOINT": otlp.url, "OTEL_BSP_SCHEDULE_DELAY": "100"}


@pytest.fixture(scope="module")
def fake_stack(
    demo_model: Path, tmp_path_factory: pytest.TempPathFactory, otlp: OtlpReceiver
) -> Iterator[tuple[Stack, str]]:
    client = redis.Redis.from_url(FAKE_REDIS_URL)
    client.flushdb()
    client.close()
    stack = Stack(
        demo_model,
        "tiny",
        FAKE_REDIS_URL,
        tmp_path_factory.mktemp("fake-logs"),
        data_dir=tmp_path_factory.mktemp("fake-data"),
    )
    fake = {"CONVEYOR_ENGINE": "fake", "CONVEYOR_FAKE_STEP_BASE_MS": "1", **traced(otlp)}
    try:
        workers = [stack.start_worker(f"fake-{i}", **fake) for i in range(2)]
        _, base_url = stack.start_gateway(**traced(otlp))
        wait_until(f"{base_url}/ready", status=200, process=workers[0], timeout_s=60)
        yield stack, base_url
    finally:
        stack.stop_all()
    stack.assert_no_safety_net()


@pytest.fixture
def client(fake_stack: tuple[Stack, str]) -> openai.OpenAI:
    _, base_url = fake_stack
    return openai.OpenAI(base_url=f"{base_url}/v1", api_key="unused", max_retries=0)


def test_workers_say_they_are_fake(fake_stack: tuple[Stack, str]) -> None:
    stack, _ = fake_stack
    for name in ("fake-0", "fake-1"):
        log = (stack.log_dir / f"{name}.log").read_text()
        assert "fake engine (no model)" in log and "its output is not a model's" in log


# ------------------------------------------------------------- a real Prometheus


@pytest.fixture(scope="module")
def prometheus(
    fake_stack: tuple[Stack, str], tmp_path_factory: pytest.TempPathFactory
) -> Iterator[str]:
    """Debian's Prometheus scraping the stack's gateway every second; its HTTP API URL."""
    binary = shutil.which("prometheus")
    if binary is None:
        pytest.skip("no prometheus binary (scripts/install.sh installs Debian's package)")
    _, base_url = fake_stack
    folder = tmp_path_factory.mktemp("prometheus")
    target = base_url.removeprefix("http://")
    (folder / "prometheus.yml").write_text(
        "global: {scrape_interval: 1s, evaluation_interval: 1s}\n"
        "scrape_configs:\n"
        f"  - {{job_name: conveyor, static_configs: [{{targets: ['{target}']}}]}}\n"
    )
    port = free_port()
    log_path = folder / "prometheus.log"
    with log_path.open("ab") as log:
        popen = subprocess.Popen(
            [
                binary,
                f"--config.file={folder / 'prometheus.yml'}",
                f"--storage.tsdb.path={folder / 'data'}",
                f"--web.listen-address=127.0.0.1:{port}",
            ],
            stdout=log,
            stderr=subprocess.STDOUT,
            stdin=subprocess.DEVNULL,
            start_new_session=True,
        )
    process = Process("prometheus", popen, log_path)
    url = f"http://127.0.0.1:{port}"
    try:
        wait_until(f"{url}/-/ready", status=200, process=process, timeout_s=60)
        yield url
    finally:
        process.stop()


def promql(url: str, query: str, at: float | None = None) -> list[dict[str, Any]]:
    params = {"query": query} if at is None else {"query": query, "time": str(at)}
    answer = httpx.get(f"{url}/api/v1/query", params=params, timeout=10).json()
    assert answer["status"] == "success", answer
    result: list[dict[str, Any]] = answer["data"]["result"]
    return result


def test_prometheus_sees_the_burst_the_clients_saw(
    fake_stack: tuple[Stack, str], prometheus: str, client: openai.OpenAI
) -> None:
    """A real Prometheus scraping /metrics every second: vllm:num_requests_running rose
    during a burst, and rate(vllm:generation_tokens_total[1m]) is the tokens the clients
    counted. Early in the module: the TSDB starts at the stack's first zero, so rate()
    extrapolates nothing (its window holds every sample, from 0)."""
    while not promql(prometheus, "vllm:generation_tokens_total"):  # a first scrape
        time.sleep(0.2)
    started = time.time()
    counted = burst(client, streams=8, max_tokens=BURST_TOKENS)
    seen = time.time() + 2.5  # two more scrapes
    time.sleep(max(0.0, seen - time.time()))
    [last] = promql(prometheus, "timestamp(vllm:generation_tokens_total)")
    at = float(last["value"][1])  # no extrapolation past the last sample
    window = f"[{int(at - started) + 2}s:1s]"
    [running] = promql(prometheus, f"max_over_time(sum(vllm:num_requests_running){window})", at)
    assert float(running["value"][1]) > 0
    [rate] = promql(prometheus, "sum(rate(vllm:generation_tokens_total[1m]))", at)
    per_minute = float(rate["value"][1]) * 60
    assert abs(per_minute - counted) <= 0.05 * counted, (per_minute, counted)


BURST_TOKENS = 1500
"""Per stream: the engine runs the burst for seconds (1 ms steps), longer than a
heartbeat (0.375 s) plus the gateway's directory refresh (1 s) plus a scrape."""


def burst(client: openai.OpenAI, *, streams: int, max_tokens: int) -> int:
    """``streams`` concurrent streams; the completion tokens their clients counted."""

    def one(_: int) -> int:
        stream = client.chat.completions.create(
            model="tiny", messages=MESSAGES, max_tokens=max_tokens, stream=True,
            stream_options={"include_usage": True},
        )  # fmt: skip
        chunks = list(stream)
        usage = chunks[-1].usage
        assert usage is not None
        return usage.completion_tokens

    with ThreadPoolExecutor(streams) as pool:
        return sum(pool.map(one, range(streams)))


def test_chat_streams_with_usage(client: openai.OpenAI) -> None:
    stream = client.chat.completions.create(
        model="tiny",
        messages=MESSAGES,
        max_tokens=12,
        temperature=0,
        stream=True,
        stream_options={"include_usage": True},
    )
    chunks = list(stream)
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    finish = [
        c.choices[0].finish_reason for c in chunks if c.choices and c.choices[0].finish_reason
    ]
    usage = chunks[-1].usage
    assert text and finish == ["length"]
    assert usage is not None and usage.completion_tokens == 12 and usage.prompt_tokens > 0
    assert usage.total_tokens == usage.prompt_tokens + 12


def test_greedy_twice_gives_the_same_text(client: openai.OpenAI) -> None:
    answers = [
        client.chat.completions.create(
            model="tiny",
            messages=MESSAGES,
            max_tokens=16,
            temperature=0,
        )
        for _ in range(2)
    ]
    texts = [a.choices[0].message.content for a in answers]
    assert texts[0] and texts[0] == texts[1]
    assert answers[1].usage is not None and answers[1].usage.completion_tokens == 16


def test_n_choices_and_logprobs(client: openai.OpenAI) -> None:
    answer = client.chat.completions.create(
        model="tiny",
        messages=MESSAGES,
        max_tokens=5,
        n=3,
        temperature=0,
        logprobs=True,
        top_logprobs=2,
    )
    assert len(answer.choices) == 3
    assert len({c.message.content for c in answer.choices}) == 1  # greedy: all the same
    for choice in answer.choices:
        assert choice.logprobs is not None and choice.logprobs.content is not None
        assert len(choice.logprobs.content) == 5
        assert all(len(t.top_logprobs) == 2 for t in choice.logprobs.content)


def test_the_prefix_index_fills_from_the_workers_kv_events(
    fake_stack: tuple[Stack, str], client: openai.OpenAI
) -> None:
    _, base_url = fake_stack
    words = " ".join(f"word{i}" for i in range(100))  # several 16-token KV blocks
    client.chat.completions.create(
        model="tiny", messages=[{"role": "user", "content": words}], max_tokens=2
    )

    def indexed() -> bool:
        index = httpx.get(f"{base_url}/admin/state", timeout=5).json()["placement_index"]
        return any(blocks > 0 for blocks in index["workers"].values())

    eventually_sync(indexed, timeout_s=10, what="a worker's blocks in the gateway's index")


def scrape(base_url: str) -> dict[tuple[str, frozenset[tuple[str, str]]], float]:
    text = httpx.get(f"{base_url}/metrics", timeout=5).text
    return {
        (s.name, frozenset(s.labels.items())): s.value
        for family in text_string_to_metric_families(text)
        for s in family.samples
    }


def total(samples: dict[tuple[str, frozenset[tuple[str, str]]], float], name: str) -> float:
    return sum(value for (sample, _), value in samples.items() if sample == name)


def test_metrics_under_a_burst(fake_stack: tuple[Stack, str], client: openai.OpenAI) -> None:
    """During a burst the workers' heartbeats show running sequences, and afterwards the
    gateway's generation-token counter grew by exactly what the clients counted."""
    _, base_url = fake_stack
    before = total(scrape(base_url), "vllm:generation_tokens_total")
    with ThreadPoolExecutor(1) as pool:
        clients = pool.submit(burst, client, streams=8, max_tokens=BURST_TOKENS)
        running = 0.0
        while not clients.done() and running == 0:
            running = total(scrape(base_url), "vllm:num_requests_running")
            time.sleep(0.05)
        counted = clients.result()
    assert running > 0
    after = total(scrape(base_url), "vllm:generation_tokens_total")
    assert after - before == counted > 0


# ------------------------------------------------------------------------- tracing

CLIENT_TRACE = "4bf92f3577b34da6a3ce929d0e0e4736"
CLIENT_SPAN = "00f067aa0ba902b7"


def live_workers(base_url: str) -> list[dict[str, object]]:
    workers: list[dict[str, object]] = httpx.get(f"{base_url}/admin/workers", timeout=5).json()[
        "data"
    ]
    return workers


def command(base_url: str, worker_id: object, name: str) -> None:
    answer = httpx.post(f"{base_url}/admin/workers/{worker_id}/{name}", timeout=10)
    assert answer.status_code == 200, answer.text


@contextmanager
def stream_when_served(
    base_url: str, body: dict[str, object], headers: dict[str, str]
) -> Iterator[httpx.Response]:
    """The stream's response once the gateway has seen a worker take the model (its
    worker directory is refreshed every second)."""
    deadline = time.monotonic() + 15
    while True:
        with httpx.stream(
            "POST", f"{base_url}/v1/chat/completions", json=body, headers=headers, timeout=30
        ) as response:
            if response.status_code != 503 or time.monotonic() > deadline:
                assert response.status_code == 200, response.read()
                yield response
                return
        time.sleep(0.2)


def wait_for_spans(otlp: OtlpReceiver, runs: int) -> list[ReceivedSpan]:
    deadline = time.monotonic() + 15
    while time.monotonic() < deadline:
        spans = otlp.trace(CLIENT_TRACE)
        served = any(  # each process exports in its own batches: wait for the gateway's too
            span.name == "POST /v1/chat/completions"
            and span.attributes.get("http.response.status_code") == 200
            for span in spans
        )
        if served and sum(span.name == "aggregated run" for span in spans) >= runs:
            return spans
        time.sleep(0.1)
    raise AssertionError(f"spans of the trace: {otlp.trace(CLIENT_TRACE)}")


def test_a_trace_follows_a_request_through_a_migration(
    fake_stack: tuple[Stack, str], otlp: OtlpReceiver
) -> None:
    """A stream starts on a slow worker, which is stopped (no grace: it hands the job
    back); another worker finishes it. The client's trace holds the gateway's spans and
    both runs, each from the worker process that did it."""
    stack, base_url = fake_stack
    others = [w["worker_id"] for w in live_workers(base_url)]
    for worker_id in others:
        command(base_url, worker_id, "drain")
    slow = stack.start_worker(
        "fake-slow",
        CONVEYOR_ENGINE="fake",
        CONVEYOR_FAKE_STEP_BASE_MS="40",
        CONVEYOR_SHUTDOWN_GRACE_S="0",
        **traced(otlp),
    )
    try:
        body = {"model": "tiny", "messages": MESSAGES, "max_tokens": 30, "stream": True}
        headers = {"traceparent": f"00-{CLIENT_TRACE}-{CLIENT_SPAN}-01"}
        tokens, finish = 0, ""
        with stream_when_served(base_url, body, headers) as response:
            assert response.headers["x-trace-id"] == CLIENT_TRACE
            for line in response.iter_lines():
                if '"finish_reason":"' in line:
                    finish = line
                if line.startswith("data: {") and '"content":"' in line:
                    tokens += 1
                    if tokens == 3:  # the slow worker is mid-stream: stop it
                        slow.terminate()
                        for worker_id in others:
                            command(base_url, worker_id, "resume")
        assert '"finish_reason":"length"' in finish  # the whole answer, once
        assert slow.reap(time.monotonic() + 30) == 0
    finally:
        for worker_id in others:
            command(base_url, worker_id, "resume")
        slow.stop()
    spans = wait_for_spans(otlp, runs=2)
    assert {span.trace_id for span in spans} == {CLIENT_TRACE}
    by_name: dict[str, list[ReceivedSpan]] = {}
    for span in spans:
        by_name.setdefault(span.name, []).append(span)
    [server] = [  # (a 503 before the gateway saw the new worker is a span of its own)
        span
        for span in by_name["POST /v1/chat/completions"]
        if span.attributes["http.response.status_code"] == 200
    ]
    assert server.parent_span_id == CLIENT_SPAN and server.service == "conveyor-gateway"
    assert {span.parent_span_id for span in by_name["admission"] + by_name["delivery"]} == {
        server.span_id
    }
    first, second = sorted(by_name["aggregated run"], key=lambda span: span.start_ns)
    assert first.parent_span_id == second.parent_span_id == server.span_id
    assert first.instance != second.instance  # two worker processes
    assert first.attributes["conveyor.run_end"] == "handed_back" and first.error
    assert second.attributes["conveyor.run_end"] == "done"
    assert second.attributes["conveyor.resumed_tokens"] >= 3
    assert len(by_name["queue wait"]) == 2
    stages = {span.name for span in spans if span.parent_span_id == second.span_id}
    assert stages == {"prefill", "decode"}
