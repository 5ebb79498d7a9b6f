"""Vision-language serving end to end, for a tiny LLaVA and a tiny Qwen2-VL.

For each model, one gateway and the official `openai` client; the topology grows
test by test:

1. an aggregated worker alone takes the raw images (the reference output);
2. an encode worker joins: the same requests go encode -> aggregated and must give
   token-identical greedy output; the same bytes under another URL hit the cache;
3. prefill + decode workers join: encode -> prefill -> decode, identical again.
"""

from __future__ import annotations

import http.server
import io
import json
import threading
import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import httpx
import openai
import pytest
import redis

from shared.demo.model import write_demo_model
from shared.queue import names
from shared.roles import Role
from tests.e2e.stack import Process, Stack, stop_together, wait_until

pytestmark = [
    pytest.mark.e2e,
    pytest.mark.vllm,
    pytest.mark.redis,
    pytest.mark.slow,
    pytest.mark.timeout(900),
]

# Long enough (with the image) to fill a 128-token KV block, so P/D moves real KV.
LONG_TEXT = " ".join(["Describe the picture in every detail, then tell a story about it."] * 12)


def _picture(color: tuple[int, int, int], size: tuple[int, int] = (64, 48)) -> bytes:
    from PIL import Image, ImageDraw

    image = Image.new("RGB", size, color)
    ImageDraw.Draw(image).rectangle((8, 8, 30, 30), fill=(255 - color[0], 40, 200))
    out = io.BytesIO()
    image.save(out, format="PNG")
    return out.getvalue()


PICTURES = {
    "red.png": _picture((220, 20, 20)),
    "green.png": _picture((20, 200, 60), (80, 80)),
    "red-again.png": _picture((220, 20, 20)),  # same bytes as red.png, another URL
    "blue.png": _picture((10, 10, 230), (40, 72)),
}


class _Pictures(http.server.BaseHTTPRequestHandler):
    def do_GET(self) -> None:
        if self.path == "/redirect-to-metadata":
            self.send_response(302)
            self.send_header("Location", "http://169.254.169.254/latest/meta-data/")
            self.end_headers()
            return
        body = PICTURES.get(self.path.lstrip("/"))
        if body is None:
            self.send_response(404)
            self.end_headers()
            return
        self.send_response(200)
        self.send_header("Content-Type", "image/png")
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)

    def log_message(self, *args: object) -> None:
        pass


@pytest.fixture(scope="module")
def picture_server() -> Iterator[str]:
    httpd = http.server.ThreadingHTTPServer(("127.0.0.1", 0), _Pictures)
    threading.Thread(target=httpd.serve_forever, daemon=True).start()
    yield f"http://127.0.0.1:{httpd.server_address[1]}"
    httpd.shutdown()
    httpd.server_close()


@dataclass
class Vision:
    kind: str
    name: str
    base_url: str
    stack: Stack
    env: dict[str, str]
    pictures: str
    reference: dict[str, list[int]] = field(default_factory=dict)
    processes: list[Process] = field(default_factory=list)

    def client(self) -> openai.OpenAI:
        return openai.OpenAI(base_url=f"{self.base_url}/v1", api_key="none", max_retries=0)

    def start(self, role: str) -> Process:
        process = self.stack.start_worker(f"{self.kind}-{role}", role=role, **self.env)
        self.processes.append(process)
        return process


@pytest.fixture(scope="module", params=["llava", "qwen2-vl"])
def vision(
    request: pytest.FixtureRequest,
    stack: Stack,
    picture_server: str,
    tmp_path_factory: pytest.TempPathFactory,
) -> Iterator[Vision]:
    kind = str(request.param)
    model: Path = write_demo_model(tmp_path_factory.mktemp("vision") / kind, kind=kind)
    env = {
        "CONVEYOR_MODEL": str(model),
        "CONVEYOR_SERVED_MODEL_NAME": f"tiny-{kind}",
        "CONVEYOR_IMAGE_PRIVATE_NETWORKS": "127.0.0.1/32",  # the picture server
        "CONVEYOR_DISAGG_MIN_PROMPT_TOKENS": "0",
    }
    gateway, url = stack.start_gateway(f"{kind}-gateway", **env)
    state = Vision(kind, f"tiny-{kind}", url, stack, env, picture_server, processes=[gateway])
    worker = state.start("aggregated")
    wait_until(f"{url}/ready", status=200, process=worker, timeout_s=600)
    try:
        yield state
    finally:
        stop_together(state.processes)


CASES: dict[str, list[str]] = {
    "one image": ["red.png"],
    "two images": ["green.png", "blue.png"],
    "long text and an image": ["blue.png"],
}


def _messages(vision: Vision, case: str, *, url_of: dict[str, str] | None = None) -> Any:
    parts: list[dict[str, Any]] = [
        {"type": "text", "text": LONG_TEXT if case.startswith("long") else "What is this?"}
    ]
    for name in CASES[case]:
        url = (url_of or {}).get(name) or f"{vision.pictures}/{name}"
        parts.append({"type": "image_url", "image_url": {"url": url}})
    return [{"role": "user", "content": parts}]


def _tokens(vision: Vision, case: str, *, stream: bool = False, **kwargs: Any) -> list[int]:
    body: dict[str, Any] = {
        "model": vision.name,
        "messages": _messages(vision, case, **kwargs),
        "max_tokens": 16,
        "temperature": 0,
        "extra_body": {"ignore_eos": True, "return_token_ids": True},
    }
    client = vision.client()
    if not stream:
        response = client.chat.completions.create(**body)
        return list(response.choices[0].model_extra["token_ids"])  # type: ignore[index]
    tokens: list[int] = []
    for chunk in client.chat.completions.create(stream=True, **body):
        for choice in chunk.choices:
            tokens.extend((choice.model_extra or {}).get("token_ids") or [])
    return tokens


def _registry(vision: Vision, role: str) -> dict[str, Any]:
    client = redis.Redis.from_url(vision.stack.redis_url)
    try:
        for key in client.scan_iter(names.WORKER_HEARTBEAT_PATTERN):
            value = client.get(key)
            worker = json.loads(value) if value else {}
            if worker.get("model") == vision.name and worker.get("role") == role:
                return dict(worker)
    finally:
        client.close()
    return {}


def _wait_for_roles(vision: Vision, roles: set[str], processes: list[Process]) -> None:
    deadline = time.monotonic() + 600
    while time.monotonic() < deadline:
        for process in processes:
            assert process.popen.poll() is None, process.log_tail()
        pools = httpx.get(f"{vision.base_url}/admin/state", timeout=10).json()["pools"]
        if all(pools.get(vision.name, {}).get(role) for role in roles):
            return
        time.sleep(0.5)
    raise TimeoutError(f"roles {roles} not live")


# ---------------------------------------------------------------- 1. raw images


def test_aggregated_worker_takes_raw_images(vision: Vision) -> None:
    for case in CASES:
        vision.reference[case] = _tokens(vision, case)
        assert len(vision.reference[case]) == 16
    assert _tokens(vision, "one image", stream=True) == vision.reference["one image"]
    # Different images give different output (the image really reaches the model).
    other = _tokens(vision, "one image", url_of={"red.png": f"{vision.pictures}/blue.png"})
    assert other != vision.reference["one image"]


@pytest.mark.parametrize(
    ("url", "reason"),
    [
        ("ftp://example.com/a.png", "scheme 'ftp' is not allowed"),
        ("http://10.1.2.3/a.png", "non-public address"),
        ("/redirect-to-metadata", "169.254.169.254, a non-public address"),
        ("data:image/png;base64,bm90IGFuIGltYWdl", "not a JPEG, PNG or WEBP"),
        ("data:image/png;base64,@@@", "broken base64"),
        ("/missing.png", "HTTP 404"),
    ],
)
def test_bad_images_are_400s_and_nothing_is_queued(vision: Vision, url: str, reason: str) -> None:
    if url.startswith("/"):
        url = vision.pictures + url
    client = redis.Redis.from_url(vision.stack.redis_url)
    streams = [names.job_stream(vision.name, role) for role in (Role.AGGREGATED, Role.ENCODE)]
    try:
        before = [
            client.xinfo_stream(s)["entries-added"] if client.exists(s) else 0 for s in streams
        ]
        with pytest.raises(openai.BadRequestError) as caught:
            _tokens(vision, "one image", url_of={"red.png": url})
        after = [
            client.xinfo_stream(s)["entries-added"] if client.exists(s) else 0 for s in streams
        ]
    finally:
        client.close()
    error = caught.value.body
    assert isinstance(error, dict)
    assert reason in error["message"] and error["param"] == "messages[0].content[1]"
    assert after == before


# --------------------------------------------------------- 2. encode -> aggregated


def test_encode_then_aggregated_matches_raw(vision: Vision) -> None:
    encoder = vision.start("encode")
    _wait_for_roles(vision, {"encode"}, [encoder])
    for case in CASES:
        assert _tokens(vision, case) == vision.reference[case], case
    assert _tokens(vision, "two images", stream=True) == vision.reference["two images"]
    assert "image(s) encoded" in encoder.log_path.read_text()


def test_same_bytes_under_another_url_hit_the_embedding_cache(vision: Vision) -> None:
    before = _settled_stats(vision)
    tokens = _tokens(vision, "one image", url_of={"red.png": f"{vision.pictures}/red-again.png"})
    assert tokens == vision.reference["one image"]
    after = _wait_for_stats(vision, lambda stats: stats["hits"] > before["hits"])
    assert after["misses"] == before["misses"], "the same bytes were encoded again"
    assert 0 < after["bytes"] <= after["max_bytes"]


def _settled_stats(vision: Vision) -> dict[str, int]:
    """The cache counters once the registry has caught up (two equal reads a beat apart)."""
    last = _wait_for_stats(vision, lambda stats: stats is not None)
    while True:
        time.sleep(1.0)
        now = _wait_for_stats(vision, lambda stats: stats is not None)
        if now == last:
            return now
        last = now


def _wait_for_stats(vision: Vision, ready: Any) -> dict[str, int]:
    deadline = time.monotonic() + 15
    while True:
        stats = _registry(vision, "encode").get("embedding_cache")
        if ready(stats) or time.monotonic() > deadline:
            assert stats is not None, "the encode worker reports no cache stats"
            return dict(stats)
        time.sleep(0.5)


# ------------------------------------------------- 3. encode -> prefill -> decode


def test_encode_prefill_decode_matches_raw(vision: Vision) -> None:
    prefill, decode = vision.start("prefill"), vision.start("decode")
    _wait_for_roles(vision, {"prefill", "decode"}, [prefill, decode])
    for case in CASES:
        assert _tokens(vision, case) == vision.reference[case], case
    assert (
        _tokens(vision, "long text and an image", stream=True)
        == (vision.reference["long text and an image"])
    )
    assert "handed to decode" in prefill.log_path.read_text()
