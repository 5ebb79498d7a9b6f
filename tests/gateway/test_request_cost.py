"""No request's gateway cost grows faster than its size: deterministic counts, not time.

For each family of inputs (unknown fields, wide and deep schemas, stop lists, messages,
content parts, tools, embedding inputs, prompt lists, logit_bias) a request of size N
and one of size 4N are sent through the in-process gateway, and its own work is
counted: Python calls into gateway/ and shared/ (cProfile, in the thread the app runs
in) and the bytes it queues in Redis. The larger may cost at most 4.5 times the smaller
plus a constant. Every request passes every check and is queued (a 504 at its 10 ms
deadline), so the whole path before the worker is measured.
"""

from __future__ import annotations

import cProfile
import pstats
from collections.abc import Callable
from dataclasses import replace
from pathlib import Path
from typing import Any

import pytest
from fastapi.testclient import TestClient

from gateway.catalog.served_models import ServedModel
from tests.gateway.harness import BODIES, CHAT, COMPLETIONS, EMBEDDINGS, build_gateway
from tests.gateway.test_http_fuzz_shapes import nested, post


@pytest.fixture(scope="module")
def roomy(served_model: ServedModel) -> Any:
    """A gateway whose ``tiny`` has a 2048-token window, for requests of many parts."""
    return build_gateway(
        replace(served_model, max_model_len=2048),
        workers=True,
        request_timeout_s=0.01,
        max_request_timeout_s=0.01,
        queue_max_depth=4096,
    )


ROOT = str(Path(__file__).resolve().parents[2])
OURS = (f"{ROOT}/gateway/", f"{ROOT}/shared/")
FAMILIES: dict[str, Callable[[int], tuple[str, dict[str, Any]]]] = {
    "unknown fields": lambda n: (
        CHAT,
        {**BODIES[CHAT], **{f"x{i}": {"y": [i] * 4} for i in range(n)}},
    ),
    "wide schema": lambda n: (
        CHAT,
        {
            **BODIES[CHAT],
            "response_format": {
                "type": "json_schema",
                "json_schema": {
                    "name": "o",
                    "schema": {
                        "type": "object",
                        "properties": {f"p{i}": {"type": "integer"} for i in range(n)},
                    },
                },
            },
        },
    ),
    "deep schema": lambda n: (
        CHAT,
        {
            **BODIES[CHAT],
            "tools": [{"type": "function", "function": {"name": "f", "parameters": nested(n)}}],
            "tool_choice": "required",
        },
    ),
    "stop list": lambda n: (
        COMPLETIONS,
        {**BODIES[COMPLETIONS], "stop": [f"s{i:04d}" for i in range(n)]},
    ),
    "messages": lambda n: (
        CHAT,
        {**BODIES[CHAT], "messages": [{"role": "user", "content": f"m{i}"} for i in range(n)]},
    ),
    "content parts": lambda n: (
        CHAT,
        {
            **BODIES[CHAT],
            "messages": [
                {"role": "user", "content": [{"type": "text", "text": f"t{i}"} for i in range(n)]}
            ],
        },
    ),
    "tools": lambda n: (
        CHAT,
        {
            **BODIES[CHAT],
            "tools": [
                {
                    "type": "function",
                    "function": {
                        "name": f"f{i}",
                        "parameters": {"type": "object", "properties": {"a": {"type": "string"}}},
                    },
                }
                for i in range(n)
            ],
            "tool_choice": "required",
        },
    ),
    "embedding inputs": lambda n: (
        EMBEDDINGS,
        {**BODIES[EMBEDDINGS], "input": [f"i{i}" for i in range(n)]},
    ),
    "prompt list": lambda n: (
        COMPLETIONS,
        {**BODIES[COMPLETIONS], "prompt": [f"p{i}" for i in range(n)]},
    ),
    "logit bias": lambda n: (CHAT, {**BODIES[CHAT], "logit_bias": {str(i): 1 for i in range(n)}}),
}
SIZES = {"deep schema": 3, "stop list": 8, "unknown fields": 16, "logit bias": 60}


def work(client: TestClient, gateway: Any, path: str, body: dict[str, Any]) -> tuple[int, int]:
    """(Python calls into the gateway's own packages, bytes it queued in Redis) for one
    request, which must pass every check and reach the queue."""
    before = queued_bytes(gateway)
    profile = cProfile.Profile()
    portal: Any = client.portal  # the app runs in the portal's thread: profile that one
    portal.call(profile.enable)
    response = post(client, path, body)
    portal.call(profile.disable)
    assert response.status_code == 504, response.text[:300]  # queued, then the deadline
    stats: Any = pstats.Stats(profile).stats
    calls = sum(row[1] for (file, _, _), row in stats.items() if file.startswith(OURS))
    return calls, queued_bytes(gateway) - before


def queued_bytes(gateway: Any) -> int:
    roles = [("aggregated", "tiny"), ("embed", "tiny-embed")]
    return sum(
        len(k) + len(v) for r, m in roles for f in gateway.queued(r, m) for k, v in f.items()
    )


@pytest.mark.parametrize("family", sorted(FAMILIES))
def test_gateway_cost_grows_no_faster_than_the_request(roomy: Any, family: str) -> None:
    with TestClient(roomy.app, raise_server_exceptions=False) as client:
        check_growth(client, roomy, family)


def check_growth(client: TestClient, gateway: Any, family: str) -> None:
    n = SIZES.get(family, 16)
    small_path, small = FAMILIES[family](n)
    large_path, large = FAMILIES[family](4 * n)
    work(client, gateway, small_path, small)  # warm every cache once
    small_calls, small_bytes = work(client, gateway, small_path, small)
    large_calls, large_bytes = work(client, gateway, large_path, large)
    print(f"{family}: calls {small_calls} -> {large_calls} ({large_calls / small_calls:.2f}x), "
          f"queued bytes {small_bytes} -> {large_bytes}")  # fmt: skip
    assert large_calls <= 4.5 * small_calls + 200, (small_calls, large_calls)
    assert large_bytes <= 4.5 * small_bytes + 2048, (small_bytes, large_bytes)
