"""A real gateway and a worker on a ``redis+sentinel://`` URL, through a master SIGKILL.

The Sentinel group is real (tests/support/sentinel.py: a master, a replica, three
Sentinels); the worker is the real worker runtime around the tests' scripted engine
(``python -m bench.fake_cluster``: token ids 100, 101, ... one per 10 ms), so no model
is loaded; the gateway is ``conveyor gateway`` on the generated demo model's tokenizer.
A stream running when the master dies either completes with every token, once and in
order, or ends with a clean OpenAI-shaped error; new requests succeed once a replica is
promoted. The stream's longest pause and the time from the SIGKILL to the first answered
new request are printed (docs/operations/several-hosts.md).
"""

from __future__ import annotations

import subprocess
import sys
import time
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path

import openai
import pytest

from shared.connections.url import sync_client
from tests.e2e.stack import Process, Stack, wait_until
from tests.support.sentinel import SentinelGroup

pytestmark = [pytest.mark.e2e, pytest.mark.redis, pytest.mark.slow, pytest.mark.timeout(300)]

MODEL = "fake-model"  # bench.fake_cluster's
TOKENS = 300
STEP_S = 0.01
RECOVERY_BOUND_S = 20.0


@dataclass
class Cluster:
    group: SentinelGroup
    stack: Stack
    gateway: Process
    worker: subprocess.Popen[bytes]
    url: str

    def client(self) -> openai.OpenAI:
        return openai.OpenAI(base_url=f"{self.url}/v1", api_key="unused", max_retries=0, timeout=60)


@pytest.fixture(scope="module")
def cluster(demo_model: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Cluster]:
    group = SentinelGroup(tmp_path_factory.mktemp("sentinel"))
    group.start()
    log_dir = tmp_path_factory.mktemp("logs")
    stack = Stack(demo_model, MODEL, group.url, log_dir, data_dir=tmp_path_factory.mktemp("data"))
    worker = None
    try:
        with (log_dir / "worker.log").open("ab") as log:
            command = [sys.executable, "-m", "bench.fake_cluster", group.url, "16"]
            worker = subprocess.Popen(
                [*command, str(TOKENS), str(STEP_S)],
                env=stack.env(),
                stdout=log,
                stderr=subprocess.STDOUT,
                start_new_session=True,
            )
        gateway, url = stack.start_gateway()
        wait_until(f"{url}/ready", status=200, process=gateway, timeout_s=120)
        yield Cluster(group, stack, gateway, worker, url)
    finally:
        if worker is not None:
            worker.terminate()
            worker.wait(30)
        stack.stop_all()
        group.stop()


@dataclass
class Streamed:
    ids: list[int]
    ended: str
    """``length`` (all tokens) or the type of the error that ended it."""
    longest_pause_s: float


def stream_ids(cluster: Cluster, on_tokens: int = 0) -> Streamed:
    """One streamed completion; kills the master once ``on_tokens`` tokens arrived (0:
    never)."""
    stream = cluster.client().completions.create(
        model=MODEL,
        prompt="Hello",
        max_tokens=TOKENS,
        stream=True,
        extra_body={"return_token_ids": True},
    )
    ids: list[int] = []
    ended = "no finish"
    last, longest = time.monotonic(), 0.0
    try:
        for chunk in stream:
            longest, last = max(longest, time.monotonic() - last), time.monotonic()
            for choice in chunk.choices:
                ids += (choice.model_extra or {}).get("token_ids") or []
                ended = choice.finish_reason or ended
            if on_tokens and len(ids) >= on_tokens and cluster.group.killed_at is None:
                cluster.group.kill_master()
    except openai.APIError as exc:  # an SSE error event
        body = exc.body if isinstance(exc.body, dict) else {}
        assert body.get("message") and body.get("type"), exc.body  # OpenAI-shaped
        ended = str(body["type"])
    return Streamed(ids, ended, longest)


def test_a_stream_through_a_master_kill_and_requests_during_it(cluster: Cluster) -> None:
    everything = list(range(100, 100 + TOKENS))
    before = stream_ids(cluster)
    assert (before.ids, before.ended) == (everything, "length")

    with ThreadPoolExecutor(1) as pool:
        probe = pool.submit(first_answer_after_the_kill, cluster)
        through = stream_ids(cluster, on_tokens=50)
        answered_s, refusals = probe.result()
    print(
        f"\nstream through the kill: {len(through.ids)} tokens, ended {through.ended!r}, "
        f"longest pause {through.longest_pause_s:.2f}s; new requests answered again "
        f"{answered_s:.2f}s after the SIGKILL (refused before: {sorted(refusals)})"
    )
    if through.ended == "length":  # completed: every token once, in order
        assert through.ids == everything
    else:  # a clean error, and what came before it was right
        assert through.ids == everything[: len(through.ids)]
    assert refusals <= {503}  # the job queue was unreachable: 503 + Retry-After
    assert cluster.group.master_address()[1] == cluster.group.replica_port

    after = stream_ids(cluster)
    assert (after.ids, after.ended) == (everything, "length")
    assert cluster.gateway.popen.poll() is None and cluster.worker.poll() is None
    assert_nothing_left(cluster)


def first_answer_after_the_kill(cluster: Cluster) -> tuple[float, set[int]]:
    """Seconds from the SIGKILL to the first request answered, and the statuses before."""
    while cluster.group.killed_at is None:
        time.sleep(0.005)
    killed_at, refusals = cluster.group.killed_at, set()
    while True:
        try:
            done = cluster.client().completions.create(model=MODEL, prompt="Hi", max_tokens=5)
            assert done.usage is not None and done.usage.completion_tokens == 5
            return time.monotonic() - killed_at, refusals
        except openai.APIStatusError as exc:
            refusals.add(exc.status_code)
        assert time.monotonic() - killed_at < RECOVERY_BOUND_S, refusals
        time.sleep(0.05)


def assert_nothing_left(cluster: Cluster) -> None:
    """No job queued or running on the promoted master once the streams are done."""
    client = sync_client(cluster.group.url, timeout_s=2.0, connect_timeout_s=2.0)
    try:
        deadline = time.monotonic() + 10
        while list(client.scan_iter("conveyor:run:*")):
            assert time.monotonic() < deadline, list(client.scan_iter("conveyor:run:*"))
            time.sleep(0.1)
    finally:
        client.close()
