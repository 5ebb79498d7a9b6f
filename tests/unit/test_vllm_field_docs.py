"""Every field of the installed vLLM's chat and completion request bodies is listed in
docs/api.md's request tables (honoured, refused or ignored), and every vLLM field the
gateway does not declare is refused or ignored on purpose (gateway/openai/vllm_fields.py).
A vLLM upgrade that adds a field fails here until the field is decided and documented."""

from __future__ import annotations

import re
from pathlib import Path

import pytest
from pydantic import BaseModel
from vllm.entrypoints.openai.chat_completion.protocol import (
    ChatCompletionRequest as VllmChatRequest,
)
from vllm.entrypoints.openai.completion.protocol import CompletionRequest as VllmCompletionRequest

from gateway.openai import vllm_fields
from gateway.openai.schemas import ChatCompletionRequest, CompletionRequest
from shared.errors import UnsupportedParameter

API_PAGE = Path(__file__).resolve().parents[2] / "docs" / "api.md"
PAIRS: list[tuple[type[BaseModel], type[BaseModel]]] = [
    (VllmChatRequest, ChatCompletionRequest),
    (VllmCompletionRequest, CompletionRequest),
]


def documented_names() -> set[str]:
    """Names in backticks in the request-field tables and the completions paragraph."""
    page = API_PAGE.read_text()
    section = page[page.index("## Request fields") : page.index("## Headers")]
    return set(re.findall(r"`([A-Za-z_][A-Za-z0-9_.]*)`", section))


@pytest.mark.parametrize(("vllm_request", "ours"), PAIRS, ids=["chat", "completions"])
def test_every_vllm_field_is_documented(
    vllm_request: type[BaseModel], ours: type[BaseModel]
) -> None:
    names = documented_names()
    missing = sorted(set(vllm_request.model_fields) - names)
    assert not missing, f"vLLM's {vllm_request.__name__} fields missing from docs/api.md"


@pytest.mark.parametrize(("vllm_request", "ours"), PAIRS, ids=["chat", "completions"])
def test_every_undeclared_vllm_field_is_decided(
    vllm_request: type[BaseModel], ours: type[BaseModel]
) -> None:
    decided = set(vllm_fields.REFUSED) | set(vllm_fields.IGNORED) | {"reasoning_effort"}
    undecided = sorted(set(vllm_request.model_fields) - set(ours.model_fields) - decided)
    assert not undecided, "add each to gateway/openai/vllm_fields.py (refused or ignored)"


def test_no_stale_decisions() -> None:
    every = set(VllmChatRequest.model_fields) | set(VllmCompletionRequest.model_fields)
    assert set(vllm_fields.REFUSED) | set(vllm_fields.IGNORED) <= every


def test_refused_fields_take_vllms_default() -> None:
    vllm_fields.refuse({"priority": 0, "bad_words": [], "request_id": "x"}, chat=True)
    vllm_fields.refuse({"add_special_tokens": True}, chat=False)
    vllm_fields.refuse({"chat_template": "{{ x }}"}, chat=False)  # not a completions field
    with pytest.raises(UnsupportedParameter) as caught:
        vllm_fields.refuse({"add_special_tokens": True}, chat=True)
    assert caught.value.param == "add_special_tokens"
