"""vLLM's chat rendering fields on chat completions (``chat_template_kwargs``,
``add_generation_prompt``, ``continue_final_message``, custom roles): the prompt a worker
receives, and the 400s (real app in process, fake workers)."""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import pytest
from fastapi.testclient import TestClient

from gateway.catalog.served_models import ServedModel
from shared.protocol import GenerateJob, decode
from tests.gateway.harness import (
    BODIES,
    CHAT,
    USER,
    InProcessGateway,
    build_gateway,
    error_of,
    passed_every_check,
)

TURNS = [*USER, {"role": "assistant", "content": "Once upon"}]


@pytest.fixture(scope="module")
def gateway(served_model: ServedModel) -> InProcessGateway:
    return build_gateway(
        served_model, workers=True, request_timeout_s=0.05, max_request_timeout_s=0.05
    )


@pytest.fixture(scope="module")
def client(gateway: InProcessGateway) -> Iterator[TestClient]:
    with TestClient(gateway.app, raise_server_exceptions=False) as test_client:
        yield test_client


@pytest.fixture(scope="module")
def decoded(served_model: ServedModel) -> Any:
    return served_model.tokenizer.decode


def prompt(client: TestClient, gateway: InProcessGateway, **fields: Any) -> list[int]:
    passed_every_check(client.post(CHAT, json={**BODIES[CHAT], **fields}))
    job = decode(gateway.queued()[-1])
    assert isinstance(job, GenerateJob)
    return job.prompt_token_ids


def test_continue_final_message_leaves_the_last_message_open(
    client: TestClient, gateway: InProcessGateway, decoded: Any
) -> None:
    text = decoded(
        prompt(
            client,
            gateway,
            messages=TURNS,
            add_generation_prompt=False,
            continue_final_message=True,
        )
    )
    assert text.endswith("Once upon")
    closed = decoded(prompt(client, gateway, messages=TURNS, add_generation_prompt=False))
    assert not closed.endswith("Once upon") and "Once upon" in closed


def test_without_a_generation_prompt_the_answer_turn_is_not_opened(
    client: TestClient, gateway: InProcessGateway
) -> None:
    opened = prompt(client, gateway, messages=USER)
    bare = prompt(client, gateway, messages=USER, add_generation_prompt=False)
    assert opened[: len(bare)] == bare and len(opened) > len(bare)


def test_a_custom_role_is_rendered_by_the_template(
    client: TestClient, gateway: InProcessGateway, decoded: Any
) -> None:
    text = decoded(
        prompt(client, gateway, messages=[{"role": "narrator", "content": "Once"}, *USER])
    )
    assert "narrator" in text


@pytest.mark.parametrize(
    ("fields", "param"),
    [
        ({"continue_final_message": True}, None),  # with add_generation_prompt (default)
        ({"chat_template_kwargs": {"messages": []}}, "chat_template_kwargs"),
        ({"messages": [{"role": "narrator"}]}, "messages[0]"),
    ],
)
def test_refusals(client: TestClient, fields: dict[str, Any], param: str | None) -> None:
    error = error_of(client.post(CHAT, json={**BODIES[CHAT], **fields}))
    assert param is None or (error["param"] or "").startswith(param), error
