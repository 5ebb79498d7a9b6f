"""Auth, per-key limits and the usage ledger with the real engine and the `openai` client.

Two more gateway PROCESSES join the shared stack (same Redis, same worker, same
embedded SQLite state) with auth on: the limits' counters are fleet-wide, so one key
spread over both gateways is held to one RPM and one concurrency limit. The client
counts completion tokens itself (one ``logprobs`` entry per token) and the ledger
row of each request must say the same.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any, TypeVar

import httpx
import openai
import pytest

from tests.e2e.conftest import Running
from tests.e2e.stack import stop_together, wait_until

pytestmark = [pytest.mark.e2e, pytest.mark.vllm, pytest.mark.redis]

ADMIN_KEY = "e2e-admin-key-0123456789abcdef"
MESSAGES = [{"role": "user", "content": "Tell me about the sea."}]
AUTH_GATEWAY_ENV = {
    "CONVEYOR_ADMIN_KEY": ADMIN_KEY,
    # A short liveness TTL: the others' sweep writes a dead one's usage within seconds.
    "CONVEYOR_GATEWAY_LIVENESS_TTL_S": "2",
}
T = TypeVar("T")


@dataclass(frozen=True)
class Fleet:
    model: str
    urls: tuple[str, str]

    def admin(self, method: str, path: str, **kwargs: Any) -> Any:
        response = httpx.request(
            method,
            f"{self.urls[0]}{path}",
            headers={"Authorization": f"Bearer {ADMIN_KEY}"},
            timeout=10,
            **kwargs,
        )
        assert response.status_code < 300, response.text
        return response.json()

    def create_key(self, **limits: int) -> tuple[str, str]:
        """A new inference key with ``limits``, known to both gateways: (id, secret)."""
        created = self.admin("POST", "/admin/keys", json={"name": "e2e", **limits})
        for url in self.urls:  # each gateway's key cache picks the new key up within 250 ms
            deadline = time.monotonic() + 5
            while httpx.get(f"{url}/v1/models", headers=_bearer(created["key"])).status_code != 200:
                assert time.monotonic() < deadline, f"{url} never accepted the new key"
                time.sleep(0.1)
        return created["id"], created["key"]

    def client(self, secret: str, gateway: int = 0) -> openai.OpenAI:
        return openai.OpenAI(base_url=f"{self.urls[gateway]}/v1", api_key=secret, max_retries=0)

    def ledger_row(self, key_id: str, request_id: str, timeout_s: float = 15) -> dict[str, Any]:
        """The request's usage row, once the ledger consumer has committed it."""
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            rows = self.admin("GET", "/admin/usage", params={"key": key_id, "limit": "1000"})
            found = [row for row in rows["data"] if row["request_id"] == request_id]
            if found:
                assert len(found) == 1
                return dict(found[0])
            time.sleep(0.2)
        raise AssertionError(f"no ledger row for {request_id}")


def _bearer(secret: str) -> dict[str, str]:
    return {"Authorization": f"Bearer {secret}"}


@pytest.fixture(scope="module")
def fleet(running: Running) -> Iterator[Fleet]:
    gateways = [
        running.stack.start_gateway(f"auth-gateway-{n}", **AUTH_GATEWAY_ENV) for n in range(2)
    ]
    try:
        for process, url in gateways:
            wait_until(f"{url}/ready", status=200, process=process, timeout_s=60)
        yield Fleet(running.model, (gateways[0][1], gateways[1][1]))
    finally:
        stop_together(process for process, _ in gateways)


def in_one_minute(attempt: Callable[[], T]) -> T:
    """Run ``attempt`` again (once) if it straddled a minute, passed or failed: RPM
    windows are per minute, so a new window mid-attempt proves nothing either way."""
    for last in (False, True):
        minute = int(time.time() // 60)
        try:
            result = attempt()
        except (Exception, pytest.fail.Exception):
            if last or int(time.time() // 60) == minute:
                raise
            continue
        if int(time.time() // 60) == minute:
            return result
    raise AssertionError("two attempts straddled a minute boundary")


def _chat(client: openai.OpenAI, model: str, **extra: Any) -> Any:
    return client.chat.completions.create(
        model=model,
        messages=MESSAGES,  # type: ignore[arg-type]
        max_tokens=extra.pop("max_tokens", 12),
        logprobs=True,
        **extra,
    )


def test_auth_is_on_for_the_fleet(fleet: Fleet) -> None:
    for url in fleet.urls:
        assert httpx.get(f"{url}/v1/models").status_code == 401
        client = fleet.client("sk-conveyor-not-a-real-key")
        with pytest.raises(openai.AuthenticationError) as refused:
            _chat(client, fleet.model)
        assert refused.value.code == "invalid_api_key"


def test_limited_key_gets_429_with_ratelimit_headers(fleet: Fleet) -> None:
    def attempt() -> None:
        _, secret = fleet.create_key(rpm=2, tpm=100_000)
        client = fleet.client(secret)
        for remaining in ("1", "0"):
            raw = client.chat.completions.with_raw_response.create(
                model=fleet.model,
                messages=MESSAGES,  # type: ignore[arg-type]
                max_tokens=4,
            )
            assert raw.headers["x-ratelimit-limit-requests"] == "2"
            assert raw.headers["x-ratelimit-remaining-requests"] == remaining
            assert raw.headers["x-ratelimit-limit-tokens"] == "100000"
            assert 0 < int(raw.headers["x-ratelimit-remaining-tokens"]) < 100_000
            assert raw.headers["x-ratelimit-reset-requests"].endswith("s")
            assert raw.parse().choices[0].message.content is not None
        with pytest.raises(openai.RateLimitError) as refused:
            _chat(client, fleet.model)
        error = refused.value
        assert error.status_code == 429
        assert error.code == "rate_limit_exceeded"
        headers = error.response.headers
        assert 1 <= int(headers["retry-after"]) <= 60
        assert headers["x-ratelimit-limit-requests"] == "2"
        assert headers["x-ratelimit-remaining-requests"] == "0"

    in_one_minute(attempt)


def test_limits_hold_across_two_gateway_processes(fleet: Fleet) -> None:
    """One key, two gateway processes: concurrency 2 and RPM 4 are enforced on the sum."""

    def attempt() -> None:
        _, secret = fleet.create_key(rpm=4, max_concurrent=2)
        first, second = fleet.client(secret, 0), fleet.client(secret, 1)
        long = {"max_tokens": 1900, "stream": True, "extra_body": {"ignore_eos": True}}
        with _chat(first, fleet.model, **long) as a, _chat(second, fleet.model, **long) as b:
            next(iter(a)), next(iter(b))  # both running: the key's two slots are taken
            for client in (first, second):
                with pytest.raises(openai.RateLimitError) as refused:
                    _chat(client, fleet.model)
                assert "concurrent" in refused.value.message
        # The slots come back when the streams close; 2 requests of the 4 are left.
        _eventually(lambda: _chat(first, fleet.model, max_tokens=2) is not None)
        _chat(second, fleet.model, max_tokens=2)
        for client in (first, second):
            with pytest.raises(openai.RateLimitError) as refused:
                _chat(client, fleet.model)
            assert refused.value.response.headers["x-ratelimit-remaining-requests"] == "0"

    in_one_minute(attempt)


def _eventually(call: Callable[[], bool], timeout_s: float = 5.0) -> None:
    deadline = time.monotonic() + timeout_s
    while True:
        try:
            if call():
                return
        except openai.RateLimitError:
            if time.monotonic() > deadline:
                raise
        time.sleep(0.1)


def _counted(choice_logprobs: Any) -> int:
    return len(choice_logprobs.content or []) if choice_logprobs is not None else 0


def test_ledger_counts_what_a_non_streamed_request_returned(fleet: Fleet) -> None:
    key_id, secret = fleet.create_key()
    result = _chat(fleet.client(secret), fleet.model, n=2, temperature=1.0, max_tokens=24)
    counted = sum(_counted(choice.logprobs) for choice in result.choices)
    assert len(result.choices) == 2
    row = fleet.ledger_row(key_id, result.id)
    assert row["completion_tokens"] == counted == result.usage.completion_tokens
    assert row["prompt_tokens"] == result.usage.prompt_tokens
    assert (row["n"], row["status"]) == (2, "completed")


def test_ledger_counts_what_a_stream_delivered(fleet: Fleet) -> None:
    key_id, secret = fleet.create_key()
    stream = _chat(
        fleet.client(secret, 1),
        fleet.model,
        stream=True,
        n=2,
        temperature=1.0,
        max_tokens=20,
        stream_options={"include_usage": True},
    )
    counted, request_id, usage = 0, "", None
    for chunk in stream:
        request_id = chunk.id
        counted += sum(_counted(choice.logprobs) for choice in chunk.choices)
        usage = chunk.usage or usage
    assert usage is not None
    row = fleet.ledger_row(key_id, request_id)
    assert row["completion_tokens"] == counted == usage.completion_tokens
    assert (row["n"], row["status"]) == (2, "completed")


def test_ledger_counts_a_disconnected_stream_up_to_where_it_stopped(fleet: Fleet) -> None:
    """The client reads a few chunks and hangs up mid-generation: it pays for what it was
    sent (at least what it read, far less than the whole answer), status cancelled."""
    key_id, secret = fleet.create_key()
    counted, request_id = 0, ""
    with _chat(
        fleet.client(secret),
        fleet.model,
        stream=True,
        max_tokens=1900,
        extra_body={"ignore_eos": True},
    ) as stream:
        for read, chunk in enumerate(stream):
            request_id = chunk.id
            counted += sum(_counted(choice.logprobs) for choice in chunk.choices)
            if read == 5:
                break
    row = fleet.ledger_row(key_id, request_id)
    assert row["status"] == "cancelled"
    assert counted <= row["completion_tokens"] < 1900


def test_prefix_cache_hits_reach_usage_and_the_ledger(fleet: Fleet) -> None:
    """The same long prompt twice: vLLM serves whole 128-token blocks of the second from
    its prefix cache, and says so in usage and the ledger."""
    key_id, secret = fleet.create_key()
    client = fleet.client(secret)
    long_prompt = [{"role": "user", "content": "the tide comes in and goes out " * 60}]
    answers = [
        client.chat.completions.create(model=fleet.model, messages=long_prompt, max_tokens=2)  # type: ignore[arg-type]
        for _ in range(2)
    ]
    usage = answers[1].usage
    assert usage is not None and usage.prompt_tokens > 256
    details = usage.prompt_tokens_details
    assert details is not None and details.cached_tokens is not None
    assert details.cached_tokens >= 128 and details.cached_tokens % 128 == 0
    row = fleet.ledger_row(key_id, answers[1].id)
    assert row["cached_prompt_tokens"] == details.cached_tokens


def test_a_request_whose_gateway_died_is_billed_from_what_the_worker_sent(
    fleet: Fleet, running: Running
) -> None:
    """A third gateway is SIGKILLed mid-stream: a live gateway's sweep writes the
    request's one usage row from the worker's tally (at least what the client read)."""
    key_id, secret = fleet.create_key()
    doomed, url = running.stack.start_gateway("doomed-gateway", **AUTH_GATEWAY_ENV)
    wait_until(f"{url}/ready", status=200, process=doomed, timeout_s=60)
    client = openai.OpenAI(base_url=f"{url}/v1", api_key=secret, max_retries=0)
    counted, request_id = 0, ""
    stream = _chat(
        client, fleet.model, stream=True, max_tokens=1900, extra_body={"ignore_eos": True}
    )
    for read, chunk in enumerate(stream):
        request_id = chunk.id
        counted += sum(_counted(choice.logprobs) for choice in chunk.choices)
        if read == 5:
            break
    doomed.popen.kill()
    doomed.popen.wait()
    stream.close()
    row = fleet.ledger_row(key_id, request_id, timeout_s=60)
    assert row["status"] in ("failed", "completed")
    assert counted <= row["completion_tokens"] <= 1900
    assert row["prompt_tokens"] > 0 and row["n"] == 1
