"""Exceptions -> OpenAI-shaped error responses, through a tiny FastAPI app."""

from __future__ import annotations

import inspect
from collections.abc import Iterator
from typing import Any

import pytest
from fastapi import FastAPI
from fastapi.testclient import TestClient

from gateway.error_handlers import install_error_handlers
from gateway.openai.schemas import ChatCompletionRequest, CompletionRequest
from shared import errors
from shared.errors import ConveyorError, RemoteError, RetryableError
from shared.protocol import ErrorEvent

ERROR_CLASSES = sorted(
    (
        cls
        for _, cls in inspect.getmembers(errors, inspect.isclass)
        if issubclass(cls, ConveyorError) and cls.__module__ == errors.__name__
    ),
    key=lambda cls: cls.__name__,
)
CONCRETE = [cls for cls in ERROR_CLASSES if cls not in (ConveyorError, RetryableError)]


def make_error(cls: type[ConveyorError]) -> ConveyorError:
    if cls is RemoteError:  # what a worker reported, as it reported it
        return RemoteError(
            ErrorEvent("r", 0, 0, 0, cls.status, cls.type, cls.code, "it went wrong", "p")
        )
    if issubclass(cls, RetryableError):
        return cls("try later", retry_after_s=7, param="p")
    return cls("it went wrong", param="p")


def build_app() -> FastAPI:
    app = FastAPI()
    install_error_handlers(app)
    by_name = {cls.__name__: cls for cls in ERROR_CLASSES}

    @app.get("/raise/{name}")
    async def raise_named(name: str) -> None:
        raise make_error(by_name[name])

    @app.get("/remote")
    async def remote() -> None:
        raise RemoteError(
            ErrorEvent("r", 0, 3, 0, 504, "timeout", "deadline_exceeded", "too slow", "x")
        )

    @app.get("/crash")
    async def crash() -> None:
        raise RuntimeError("secret internal detail")

    @app.post("/chat")
    async def chat(body: ChatCompletionRequest) -> dict[str, Any]:
        return {"n": body.n}

    @app.post("/completions")
    async def completions(body: CompletionRequest) -> dict[str, Any]:
        return {"prompts": len(body.prompts())}

    return app


@pytest.fixture(scope="module")
def client() -> Iterator[TestClient]:
    with TestClient(build_app(), raise_server_exceptions=False) as test_client:
        yield test_client


def assert_openai_error(body: Any) -> dict[str, Any]:
    assert set(body) == {"error"}
    error = body["error"]
    assert set(error) == {"message", "type", "param", "code"}
    assert isinstance(error["message"], str) and error["message"]
    assert isinstance(error["type"], str) and error["type"]
    return error  # type: ignore[no-any-return]


def test_error_tree_is_complete() -> None:
    names = {cls.__name__ for cls in ERROR_CLASSES}
    assert {
        "ConveyorError",
        "InvalidRequest",
        "ContextLengthExceeded",
        "IdempotencyConflict",
        "ModelNotFound",
        "RetryableError",
        "Overloaded",
        "NoLiveWorker",
        "GatewayDraining",
        "BackendUnavailable",
        "DeadlineExceeded",
        "EngineError",
        "EngineDead",
    } <= names


@pytest.mark.parametrize("cls", ERROR_CLASSES, ids=lambda cls: cls.__name__)
def test_every_error_class_has_status_and_type(cls: type[ConveyorError]) -> None:
    assert isinstance(cls.status, int)
    assert 400 <= cls.status <= 599
    assert isinstance(cls.type, str) and cls.type
    assert cls.code is None or (isinstance(cls.code, str) and cls.code)
    if cls.status in (429, 503):
        assert issubclass(cls, RetryableError), "429/503 answers must carry Retry-After"
    error = make_error(cls).to_openai()["error"]
    assert error == {
        "message": error["message"],
        "type": cls.type,
        "param": "p",
        "code": cls.code,
    }


def test_retry_after_is_at_least_one_second() -> None:
    assert errors.Overloaded("x", retry_after_s=0).retry_after_s == 1
    assert errors.NoLiveWorker("x", retry_after_s=-5).retry_after_s == 1
    assert errors.GatewayDraining("x").retry_after_s == 1


@pytest.mark.parametrize("cls", CONCRETE, ids=lambda cls: cls.__name__)
def test_handler_answers_with_status_and_shape(
    client: TestClient, cls: type[ConveyorError]
) -> None:
    response = client.get(f"/raise/{cls.__name__}")
    assert response.status_code == cls.status
    assert response.headers["content-type"].startswith("application/json")
    error = assert_openai_error(response.json())
    assert (error["type"], error["code"], error["param"]) == (cls.type, cls.code, "p")
    if issubclass(cls, RetryableError):
        assert response.headers["retry-after"] == "7"
    else:
        assert "retry-after" not in response.headers


@pytest.mark.parametrize(
    ("name", "status"),
    [
        ("Overloaded", 429),
        ("NoLiveWorker", 503),
        ("GatewayDraining", 503),
        ("BackendUnavailable", 503),
    ],
)
def test_retry_after_on_429_and_503(client: TestClient, name: str, status: int) -> None:
    response = client.get(f"/raise/{name}")
    assert response.status_code == status
    assert int(response.headers["retry-after"]) >= 1


def test_remote_error_keeps_the_workers_status(client: TestClient) -> None:
    response = client.get("/remote")
    assert response.status_code == 504
    assert assert_openai_error(response.json()) == {
        "message": "too slow",
        "type": "timeout",
        "param": "x",
        "code": "deadline_exceeded",
    }


def test_unexpected_exception_is_a_generic_500(client: TestClient) -> None:
    response = client.get("/crash")
    assert response.status_code == 500
    error = assert_openai_error(response.json())
    assert error["type"] == "server_error"
    assert "secret" not in response.text


def test_unknown_route_is_a_404_in_openai_shape(client: TestClient) -> None:
    response = client.get("/nope")
    assert response.status_code == 404
    assert assert_openai_error(response.json())["type"] == "not_found_error"


def test_wrong_method_is_a_405_in_openai_shape(client: TestClient) -> None:
    response = client.get("/chat")
    assert response.status_code == 405
    assert assert_openai_error(response.json())["type"] == "invalid_request_error"


def test_invalid_json_is_a_400(client: TestClient) -> None:
    response = client.post(
        "/chat",
        content=b'{"model": "m", "messages": [',
        headers={"content-type": "application/json"},
    )
    assert response.status_code == 400
    error = assert_openai_error(response.json())
    assert error["message"] == "The request body is not valid JSON."
    assert error["type"] == "invalid_request_error"
    assert error["param"] is None


USER = [{"role": "user", "content": "hi"}]


@pytest.mark.parametrize(
    ("body", "param"),
    [
        ({"model": "m", "messages": USER, "n": 0}, "n"),
        ({"model": "m", "messages": USER, "n": 129}, "n"),
        ({"model": "m", "messages": USER, "temperature": 3}, "temperature"),
        ({"model": "m"}, "messages"),
        ({"messages": USER}, "model"),
        ({"model": "m", "messages": [{"role": 5, "content": "x"}]}, "messages[0].role"),
        ({"model": "m", "messages": [{"role": "user", "content": 5}]}, "messages[0].content"),
        ({"model": "m", "messages": USER, "stop": 5}, "stop"),
        ({"model": "m", "messages": USER, "logprobs": True, "top_logprobs": 21}, "top_logprobs"),
    ],
)
def test_validation_error_is_a_400_with_param(
    client: TestClient, body: dict[str, Any], param: str
) -> None:
    response = client.post("/chat", json=body)
    assert response.status_code == 400
    error = assert_openai_error(response.json())
    assert error["param"] == param
    assert error["type"] == "invalid_request_error"
    assert error["code"] == "invalid_value"
    assert error["message"].startswith(f"{param}: ")


def test_completion_prompt_union_error_names_prompt(client: TestClient) -> None:
    response = client.post("/completions", json={"model": "m", "prompt": 5})
    assert response.status_code == 400
    assert assert_openai_error(response.json())["param"] == "prompt"


def test_model_level_rule_is_a_400(client: TestClient) -> None:
    body = {"model": "m", "messages": USER, "stream_options": {"include_usage": True}}
    response = client.post("/chat", json=body)
    assert response.status_code == 400
    error = assert_openai_error(response.json())
    assert "stream_options is only allowed when stream is true" in error["message"]


def test_valid_request_passes(client: TestClient) -> None:
    response = client.post("/chat", json={"model": "m", "messages": USER, "n": 2, "extra": 1})
    assert response.status_code == 200
    assert response.json() == {"n": 2}


@pytest.mark.parametrize(
    ("body", "param"),
    [
        ({"model": "m", "messages": USER, "stream": "maybe"}, "stream"),
        (
            {
                "model": "m",
                "messages": USER,
                "stream": True,
                "stream_options": {"include_usage": []},
            },
            "stream_options.include_usage",
        ),
        (
            {
                "model": "m",
                "messages": USER,
                "response_format": {
                    "type": "json_schema",
                    "json_schema": {"schema": {"type": "object"}, "strict": "very"},
                },
            },
            "response_format.json_schema.strict",
        ),
    ],
    ids=["stream", "stream_options", "strict"],
)
def test_fields_named_like_union_branches_keep_their_param(
    client: TestClient, body: dict[str, Any], param: str
) -> None:
    """'stream', 'stream_options', 'strict' start like pydantic's branch name 'str'."""
    response = client.post("/chat", json=body)
    assert response.status_code == 400
    assert assert_openai_error(response.json())["param"] == param


@pytest.mark.parametrize(
    ("path", "field", "value"),
    [
        ("/chat", "seed", 2**64),
        ("/chat", "seed", 2**63),
        ("/chat", "seed", -(2**63) - 1),
        ("/chat", "top_k", 2**64),
        ("/chat", "min_tokens", 2**64),
        ("/chat", "max_tokens", 2**64),
        ("/chat", "max_completion_tokens", 2**64),
        ("/completions", "seed", 2**64),
        ("/completions", "max_tokens", 2**31),
    ],
)
def test_out_of_range_integers_are_a_400_naming_the_field(
    client: TestClient, path: str, field: str, value: int
) -> None:
    """Integers the job protocol cannot carry are refused at the door, not a 500 later."""
    body: dict[str, Any] = {"model": "m", field: value}
    body.update({"messages": USER} if path == "/chat" else {"prompt": "hi"})
    response = client.post(path, json=body)
    assert response.status_code == 400
    error = assert_openai_error(response.json())
    assert (error["param"], error["code"]) == (field, "invalid_value")
