"""vLLM's own endpoints (/tokenize, /detokenize, /tokenizer_info, /version, /load,
/is_sleeping, /ping, /invocations) and vLLM's model card fields: the real app in
process, fake workers, fakeredis. Shapes are checked against vLLM's protocol classes."""

from __future__ import annotations

from typing import Any

import pytest

from gateway.catalog.served_models import ServedModel
from tests.gateway.fake_worker import silent
from tests.gateway.harness import BODIES, CHAT, COMPLETIONS, EMBEDDINGS, USER, LiveGateway, error_of
from tests.waiting import eventually

TOOLS = [{"type": "function", "function": {"name": "f", "parameters": {"type": "object"}}}]
CHAT_TURNS = [
    {"role": "system", "content": "be brief"},
    {"role": "user", "content": "hello there"},
]
PERMISSION_FIELDS: dict[str, type | tuple[type, ...]] = {
    "id": str,
    "object": str,
    "created": int,
    "allow_create_engine": bool,
    "allow_sampling": bool,
    "allow_logprobs": bool,
    "allow_search_indices": bool,
    "allow_view": bool,
    "allow_fine_tuning": bool,
    "organization": str,
    "group": type(None),
    "is_blocking": bool,
}


def shape(body: dict[str, Any], fields: dict[str, type | tuple[type, ...]]) -> None:
    for name, kind in fields.items():
        assert name in body, name
        assert isinstance(body[name], kind), (name, body[name])


async def chat_prompt_ids(gateway: LiveGateway, body: dict[str, Any]) -> list[int]:
    response = await gateway.client.post(CHAT, json={"model": "tiny", "max_tokens": 1, **body})
    assert response.status_code == 200, response.text
    return list(gateway.workers[0].generate_jobs()[-1].prompt_token_ids)


async def tokenize(gateway: LiveGateway, body: dict[str, Any]) -> dict[str, Any]:
    response = await gateway.client.post("/tokenize", json={"model": "tiny", **body})
    assert response.status_code == 200, response.text
    answer: dict[str, Any] = response.json()
    return answer


async def test_tokenize_a_prompt_has_vllms_shape(
    gateway: LiveGateway, served_model: ServedModel
) -> None:
    answer = await tokenize(gateway, {"prompt": "hello world", "return_token_strs": True})
    assert set(answer) == {"count", "max_model_len", "tokens", "token_strs"}
    shape(answer, {"count": int, "max_model_len": int, "tokens": list, "token_strs": list})
    assert answer["tokens"] == served_model.tokenizer.encode("hello world", add_special_tokens=True)
    assert answer["count"] == len(answer["tokens"]) == len(answer["token_strs"])
    assert answer["max_model_len"] == served_model.max_model_len
    assert all(isinstance(s, str) for s in answer["token_strs"])
    assert (await tokenize(gateway, {"prompt": "hi"}))["token_strs"] is None


async def test_tokenize_a_prompt_counts_what_completions_send(gateway: LiveGateway) -> None:
    response = await gateway.client.post(COMPLETIONS, json={**BODIES[COMPLETIONS], "max_tokens": 1})
    assert response.status_code == 200, response.text
    sent = list(gateway.workers[0].generate_jobs()[-1].prompt_token_ids)
    assert (await tokenize(gateway, {"prompt": BODIES[COMPLETIONS]["prompt"]}))["tokens"] == sent
    plain = await tokenize(gateway, {"prompt": "hello", "add_special_tokens": False})
    assert plain["count"] <= len(sent)


@pytest.mark.parametrize(
    "body",
    [{"messages": USER}, {"messages": CHAT_TURNS}, {"messages": CHAT_TURNS, "tools": TOOLS}],
)
async def test_tokenize_messages_equals_the_chat_prompt(
    gateway: LiveGateway, body: dict[str, Any]
) -> None:
    chat_body = {**body, "tool_choice": "required"} if "tools" in body else body
    sent = await chat_prompt_ids(gateway, chat_body)
    answer = await tokenize(gateway, body)
    assert answer["tokens"] == sent
    assert answer["count"] == len(sent)


async def test_tokenize_messages_template_options(
    gateway: LiveGateway, served_model: ServedModel
) -> None:
    full = (await tokenize(gateway, {"messages": USER}))["tokens"]
    bare = await tokenize(gateway, {"messages": USER, "add_generation_prompt": False})
    assert bare["count"] <= len(full)
    turns = [*USER, {"role": "assistant", "content": "Once upon"}]
    opened = await tokenize(
        gateway,
        {"messages": turns, "add_generation_prompt": False, "continue_final_message": True},
    )
    assert served_model.tokenizer.decode(opened["tokens"]).endswith("Once upon")
    special = await tokenize(gateway, {"messages": USER, "add_special_tokens": True})
    assert special["count"] >= len(full)


async def test_tokenize_refusals_are_openai_shaped(gateway: LiveGateway) -> None:
    both = {"messages": USER, "continue_final_message": True, "add_generation_prompt": True}
    refusals: list[tuple[dict[str, Any], str]] = [
        (both, "messages"),
        ({"messages": USER, "chat_template_kwargs": {"messages": []}}, "chat_template_kwargs"),
        ({"messages": []}, "messages"),
        ({"messages": USER, "chat_template": "{{ messages }}"}, "chat_template"),
        ({}, "prompt"),
        ({"model": "nope", "prompt": "x"}, "model"),
    ]
    for body, param in refusals:
        response = await gateway.client.post("/tokenize", json={"model": "tiny", **body})
        error = error_of(response, 404 if param == "model" else 400)
        assert error["param"] in (param, None), error


async def test_detokenize_round_trip(gateway: LiveGateway) -> None:
    tokens = await tokenize(gateway, {"prompt": "hello world", "add_special_tokens": False})
    response = await gateway.client.post(
        "/detokenize", json={"model": "tiny", "tokens": tokens["tokens"]}
    )
    assert response.status_code == 200, response.text
    assert response.json() == {"prompt": "hello world"}


@pytest.mark.parametrize("tokens", [[320], [5, 100000], [-1]])
async def test_detokenize_outside_the_vocabulary_is_a_400(
    gateway: LiveGateway, tokens: list[int]
) -> None:
    response = await gateway.client.post("/detokenize", json={"model": "tiny", "tokens": tokens})
    error = error_of(response)
    assert error["param"].startswith("tokens")
    assert error["type"] == "invalid_request_error"


async def test_model_is_optional_as_in_vllm(gateway: LiveGateway) -> None:
    response = await gateway.client.post("/tokenize", json={"prompt": "hi"})
    assert response.status_code == 200, response.text


async def test_tokenizer_info_is_the_json_safe_config(gateway: LiveGateway) -> None:
    response = await gateway.client.get("/tokenizer_info")
    assert response.status_code == 200, response.text
    info = response.json()
    assert isinstance(info["tokenizer_class"], str)
    assert not {"vocab_file", "merges_file", "tokenizer_file", "name_or_path"} & set(info)
    for value in (info.get("added_tokens_decoder") or {}).values():
        assert isinstance(value, str)  # vLLM shows each added token as its text
    assert (await gateway.client.get("/tokenizer_info?model=tiny-embed")).status_code == 200
    assert error_of(await gateway.client.get("/tokenizer_info?model=nope"), 404)


async def test_version_load_sleeping_and_ping(gateway: LiveGateway) -> None:
    version = (await gateway.client.get("/version")).json()
    assert set(version) == {"version"} and isinstance(version["version"], str)
    assert (await gateway.client.get("/load")).json() == {"server_load": 0}
    assert (await gateway.client.get("/is_sleeping")).json() == {"is_sleeping": False}
    for method in ("GET", "POST"):
        assert (await gateway.client.request(method, "/ping")).status_code == 200


async def test_load_counts_the_requests_in_flight(gateway: LiveGateway) -> None:
    gateway.workers[0].script = silent

    async def load() -> int:
        answer: int = (await gateway.client.get("/load")).json()["server_load"]
        return answer

    async with gateway.call(CHAT, {**BODIES[CHAT], "stream": True}) as call:
        assert await call.start() == 200
        assert await load() == 1
        call.leave()

        async def idle() -> bool:
            return await load() == 0

        await eventually(idle, timeout_s=2.0, what="the request closed")


@pytest.mark.parametrize(
    ("path", "object_"),
    [(CHAT, "chat.completion"), (COMPLETIONS, "text_completion"), (EMBEDDINGS, "list")],
)
async def test_invocations_dispatches_by_shape(
    gateway: LiveGateway, path: str, object_: str
) -> None:
    response = await gateway.client.post("/invocations", json=BODIES[path])
    assert response.status_code == 200, response.text
    assert response.json()["object"] == object_


async def test_invocations_refusals(gateway: LiveGateway) -> None:
    error = error_of(await gateway.client.post("/invocations", json={"model": "tiny"}))
    assert "Cannot find suitable handler" in error["message"]
    bad = await gateway.client.post("/invocations", json={**BODIES[CHAT], "temperature": 9})
    assert error_of(bad)["param"] == "temperature"
    garbled = await gateway.client.post("/invocations", content=b"{nope")
    assert error_of(garbled)["message"] == "The request body is not valid JSON."


async def test_model_cards_have_vllms_fields(gateway: LiveGateway) -> None:
    cards = (await gateway.client.get("/v1/models")).json()["data"]
    for card in cards:
        shape(
            card,
            {
                "id": str,
                "object": str,
                "created": int,
                "owned_by": str,
                "root": str,
                "parent": type(None),
                "max_model_len": int,
                "permission": list,
            },
        )
        # auth off acts as admin: the model's folder, as vLLM shows it (other keys see the
        # served name: tests/db/test_inference_auth.py)
        assert card["root"] == gateway.state.catalog.get(card["id"]).path
        (permission,) = card["permission"]
        assert set(permission) == set(PERMISSION_FIELDS)
        shape(permission, PERMISSION_FIELDS)
        assert permission["object"] == "model_permission"
