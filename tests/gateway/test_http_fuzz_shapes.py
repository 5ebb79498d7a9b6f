"""Fuzz what tests/gateway/test_http_fuzz.py leaves whole: headers, JSON schemas, image
parts, with a vision-language model in the catalog.

The same rule as there: no input gives a 5xx but a valid request's 504 at its 10 ms
deadline, and every error is OpenAI-shaped. Header values go out as raw bytes (latin-1
included); schemas (``response_format`` and tool parameters) are nested, wide, huge,
self-referencing or not objects at all; images are ``data:`` URLs of junk bytes and of
small odd images made in memory with Pillow (nothing is fetched over the network).
How a request's cost grows with its size: tests/gateway/test_request_cost.py.
"""

from __future__ import annotations

import base64
import io
import json
from collections.abc import Iterator
from typing import Any

import pytest
from fastapi.testclient import TestClient
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from PIL import Image

from gateway.catalog.served_models import ServedModel
from tests.gateway.harness import BODIES, CHAT, COMPLETIONS, EMBEDDINGS, build_gateway
from tests.gateway.test_http_fuzz import assert_no_server_error, json_values
from tests.support.tiny_model import build_vision_model

FUZZ = settings(
    max_examples=120,
    derandomize=True,
    deadline=None,
    database=None,
    suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow],
)
VISION = "tiny-vl"


@pytest.fixture(scope="module")
def gateway(served_model: ServedModel, tmp_path_factory: pytest.TempPathFactory) -> Any:
    vision = build_vision_model(tmp_path_factory.mktemp("vision-tokenizer"))
    return build_gateway(
        served_model,
        workers=True,
        more_models=[vision],
        request_timeout_s=0.01,
        max_request_timeout_s=0.01,
        max_request_body_bytes=1024 * 1024,
        queue_max_depth=4096,
    )


@pytest.fixture(scope="module")
def client(gateway: Any) -> Iterator[TestClient]:
    with TestClient(gateway.app, raise_server_exceptions=False) as test_client:
        yield test_client


def post(client: TestClient, path: str, body: Any, headers: dict[str, bytes] | None = None) -> Any:
    raw = json.dumps(body, allow_nan=True).encode()
    return client.post(
        path, content=raw, headers={"content-type": b"application/json", **(headers or {})}
    )


# ------------------------------------------------------------------------------ headers

AUTHORIZATION = st.sampled_from(
    [b"", b"Bearer", b"Bearer ", b"bearer x", b"Basic dXNlcjpwYXNz", b"abc",
     b"Bearer " + b"k" * 8000, b"Bearer    spaced   key", b" " * 40, b"Bearer \xe9\xff\xfe",
     b"\xe9", b"Bearer a b c",
     b"Bearer cvy-" + b"x" * 43, b"Token t"]
)  # fmt: skip
TIMEOUT = st.sampled_from(
    [b"nan", b"NaN", b"inf", b"-inf", b"Infinity", b"-1", b"-0", b"0", b"1e309", b"1e308",
     b"99999999999999999999999999", b"0x10", b"1_000", b"abc", b"", b" ", b"\xe9", b"5" * 5000,
     b"1e-320", b"0.0000001", b"3"]
)  # fmt: skip
IDEMPOTENCY = st.sampled_from(
    [b"", b" ", b"k" * 255, b"k" * 256, b"k" * 10_000, b"a\tb", b"\xe9\xe8", b"a b", b"a\x7fb",
     b"{}\"'<>", b"..%2F", b"\xff" * 8]
)  # fmt: skip
CONTENT_TYPE = st.sampled_from(
    [None, b"", b"text/plain", b"application/json; charset=utf-8",
     b"application/json; charset=latin-1", b"application/json;;;",
     b"multipart/form-data; boundary=x", b"application/x-www-form-urlencoded",
     b"APPLICATION/JSON", b"application/jsonx", b"\xe9/\xe9"]
)  # fmt: skip
HOST = st.sampled_from(
    [None, b"gw", b"testserver", b"localhost", b"127.0.0.1", b"[::1]", b"evil.example", b"",
     b"gw:99999", b"gw:", b":80", b"\xe9.example", b"a" * 300, b"gw.", b"GW", b"[::1"]
)  # fmt: skip


@pytest.mark.parametrize("path", [CHAT, COMPLETIONS, EMBEDDINGS])
def test_odd_headers_never_give_a_server_error(client: TestClient, path: str) -> None:
    @FUZZ
    @given(
        auth=st.none() | AUTHORIZATION,
        timeout=st.none() | TIMEOUT,
        key=st.none() | IDEMPOTENCY,
        content_type=CONTENT_TYPE,
        host=HOST,
        salt=st.integers(0, 10**9),
    )
    def check(
        auth: bytes | None, timeout: bytes | None, key: bytes | None,
        content_type: bytes | None, host: bytes | None, salt: int,
    ) -> None:  # fmt: skip
        headers = {"authorization": auth, "x-request-timeout": timeout, "idempotency-key": key,
                   "content-type": content_type, "host": host}  # fmt: skip
        sent = {name: value for name, value in headers.items() if value is not None}
        body = {**BODIES[path], "user": str(salt)}  # distinct bodies: idempotency keys repeat
        response = client.post(path, content=json.dumps(body).encode(), headers=sent)
        assert_no_server_error(response)
        if response.status_code == 403:
            assert response.json()["error"]["code"] == "host_not_allowed"

    check()


# ------------------------------------------------------------------------------ schemas


def nested(depth: int, leaf: Any = None) -> Any:
    schema: Any = leaf if leaf is not None else {"type": "string"}
    for _ in range(depth):
        schema = {"type": "object", "properties": {"a": schema}}
    return schema


SCHEMAS = st.one_of(
    json_values,
    st.sampled_from(
        [nested(31), nested(32), nested(33), nested(500), [nested(40)], "schema", 7, None, [],
         {"type": "object", "properties": {f"p{i}": {"type": "string"} for i in range(3000)}},
         {"type": "string", "description": "d" * 70_000}, {"type": "string", "pattern": "(a+)+$"},
         {"$ref": "#"}, {"$ref": "#/$defs/a", "$defs": {"a": {"$ref": "#/$defs/a"}}},
         {"$defs": {"n": {"type": "object", "properties": {"next": {"$ref": "#/$defs/n"}}}},
          "$ref": "#/$defs/n"},
         {"type": "nonsense"}, {"type": ["string", 3]}, {"properties": []}, {"required": "x"},
         {"enum": []}, {"anyOf": "x"}, {"type": "object", "properties": {"": {}}}, {"\ud800": 1},
         {"type": "integer", "minimum": float("nan")}, {"type": "number", "maximum": 1e400}]
    ),
)  # fmt: skip


@st.composite
def schema_bodies(draw: st.DrawFn) -> dict[str, Any]:
    body = dict(BODIES[CHAT])
    schema = draw(SCHEMAS)
    if draw(st.booleans()):
        fmt: Any = {
            "name": draw(st.sampled_from(["out", "", "x" * 100, 3, None])),
            "schema": schema,
        }
        body["response_format"] = {"type": "json_schema", "json_schema": fmt}
    else:
        function: Any = {"name": draw(st.sampled_from(["f", "f" * 65, "a b", "", 3])),
                         "parameters": schema}  # fmt: skip
        body["tools"] = [{"type": "function", "function": function}] * draw(st.integers(1, 3))
        body["tool_choice"] = draw(st.sampled_from([None, "auto", "none", "required", "f", {}]))
    return body


def test_odd_schemas_never_give_a_server_error(client: TestClient) -> None:
    @FUZZ
    @given(body=schema_bodies())
    def check(body: dict[str, Any]) -> None:
        assert_no_server_error(post(client, CHAT, body))

    check()


# ------------------------------------------------------------------------------- images


def image_bytes(fmt: str, size: tuple[int, int], mode: str = "RGB") -> bytes:
    out = io.BytesIO()
    Image.new(mode, size).save(out, format=fmt)
    return out.getvalue()


IMAGES = [
    image_bytes("PNG", (1, 1)), image_bytes("PNG", (4000, 1)), image_bytes("PNG", (1, 1), "RGBA"),
    image_bytes("PNG", (3, 3), "P"), image_bytes("PNG", (2, 2), "I;16"), image_bytes("GIF", (5, 5)),
    image_bytes("JPEG", (9, 7)), image_bytes("WEBP", (2, 2)), image_bytes("BMP", (2, 2)),
    image_bytes("TIFF", (2, 2)), image_bytes("PNG", (8, 8))[:40], b"", b"\x89PNG\r\n\x1a\n",
    b"GIF89a" + b"\xff" * 30, b"\xff\xd8\xff" + b"\x00" * 20, b"<svg/>", b"x" * 100,
    b"\x89PNG\r\n\x1a\n\x00\x00\x00\rIHDR\x7f\xff\xff\xff\x7f\xff\xff\xff\x08\x02\x00\x00\x00",
]  # fmt: skip
MEDIA = [
    "image/png",
    "image/jpeg",
    "image/gif",
    "image/svg+xml",
    "text/plain",
    "",
    "image/png;charset=x",
]


@st.composite
def image_urls(draw: st.DrawFn) -> Any:
    data = draw(st.sampled_from(IMAGES) | st.binary(max_size=64))
    media = draw(st.sampled_from(MEDIA))
    encoded = base64.b64encode(data).decode()
    return draw(
        st.sampled_from(
            [f"data:{media};base64,{encoded}", f"data:{media},{encoded}", f"data:;base64,{encoded}",
             f"data:{media};base64,{encoded[:-1]}", f"data:{media};base64,{encoded}====",
             "data:", "data:image/png;base64,", "data:image/png;base64,!!!!",
             "DATA:image/png;base64,AAAA",
             "http://169.254.169.254/latest", "file:///etc/passwd", "", "x" * 5000]
        )
        | json_values
    )  # fmt: skip


IMAGE_PARTS = st.fixed_dictionaries(
    {"type": st.sampled_from(["image_url", "image", "input_image"]) | json_values},
    optional={
        "image_url": st.fixed_dictionaries(
            {"url": image_urls()},
            optional={"detail": st.sampled_from(["auto", "low", "x"]) | json_values},
        ) | image_urls(),
        "text": json_values,
    },
)  # fmt: skip


def test_odd_image_parts_never_give_a_server_error(client: TestClient) -> None:
    @FUZZ
    @given(parts=st.lists(IMAGE_PARTS, min_size=1, max_size=10), text=st.booleans())
    def check(parts: list[Any], text: bool) -> None:
        content = [{"type": "text", "text": "describe"}, *parts] if text else parts
        body = {
            "model": VISION,
            "messages": [{"role": "user", "content": content}],
            "max_tokens": 2,
        }
        assert_no_server_error(post(client, CHAT, body))

    check()


def test_a_valid_image_reaches_the_queue(client: TestClient) -> None:
    url = "data:image/png;base64," + base64.b64encode(IMAGES[0]).decode()
    content = [
        {"type": "text", "text": "describe"},
        {"type": "image_url", "image_url": {"url": url}},
    ]
    body = {"model": VISION, "messages": [{"role": "user", "content": content}], "max_tokens": 2}
    response = post(client, CHAT, body)
    assert response.status_code == 504, response.text  # queued; the 10 ms deadline passed
