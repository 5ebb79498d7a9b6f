"""Tokenizer and chat template of a served model, without torch or transformers.

Reads a Hugging Face model folder's ``tokenizer.json`` (the `tokenizers`
library) and renders its chat template with a sandboxed Jinja environment set
up the way transformers' ``apply_chat_template`` does.
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from dataclasses import dataclass, field
from datetime import datetime
from pathlib import Path
from typing import Any

from jinja2 import TemplateError
from jinja2.sandbox import ImmutableSandboxedEnvironment
from tokenizers import Tokenizer

from shared.errors import ChatTemplateError, InvalidRequest


def _raise_exception(message: str) -> None:
    raise ChatTemplateError(message, param="messages")


def _tojson(value: Any, indent: int | None = None, **_: Any) -> str:
    return json.dumps(value, ensure_ascii=False, indent=indent)


RESERVED_TEMPLATE_VARIABLES = frozenset(
    {
        "messages",
        "tools",
        "bos_token",
        "eos_token",
        "add_generation_prompt",
        "continue_final_message",
        "raise_exception",
        "strftime_now",
    }
)
"""What the renderer sets itself: ``template_kwargs`` may not replace them."""


@dataclass(frozen=True, slots=True)
class ChatRendering:
    """How messages become a prompt (the defaults: a chat completion's prompt, as vLLM's
    server renders it; /tokenize may change each, as vLLM's does)."""

    add_generation_prompt: bool = True
    continue_final_message: bool = False
    """Leave the last message open (its end-of-turn cut off) for the model to continue."""
    add_special_tokens: bool = False
    """Special tokens (BOS) on top of those the template writes."""
    template_kwargs: Mapping[str, Any] = field(default_factory=dict)
    """More variables for the template (vLLM's ``chat_template_kwargs``)."""


CHAT_COMPLETION = ChatRendering()


class ModelTokenizer:
    def __init__(self, folder: Path) -> None:
        self._tokenizer = Tokenizer.from_file(str(folder / "tokenizer.json"))
        # Some tokenizer.json files (sentence-transformers) pad and truncate on encode:
        # prompts must be exact, and too-long inputs must be refused, not cut.
        self._tokenizer.no_padding()
        self._tokenizer.no_truncation()
        self.max_token_chars = max(
            (len(token) for token in self._tokenizer.get_vocab(with_added_tokens=True)), default=1
        )
        """The longest vocabulary entry: no token covers more characters of input text, so
        the gateway can refuse text too long for the context window without tokenizing it."""
        config = _read_json(folder / "tokenizer_config.json")
        self.config = config
        """``tokenizer_config.json`` as read (what vLLM's /tokenizer_info shows)."""
        self.bos_token = _token_text(config.get("bos_token"))
        self.eos_token = _token_text(config.get("eos_token"))
        template = config.get("chat_template")
        template_file = folder / "chat_template.jinja"
        if template_file.exists():
            template = template_file.read_text()
        if isinstance(template, list):  # named templates: take the default one
            named = {t.get("name"): t.get("template") for t in template}
            template = named.get("default") or next(iter(named.values()), None)
        self.has_chat_template = isinstance(template, str)
        self.template_source = template if isinstance(template, str) else None
        env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True)
        env.globals["raise_exception"] = _raise_exception
        env.globals["strftime_now"] = lambda fmt: datetime.now().strftime(fmt)
        env.filters["tojson"] = _tojson
        self._template = env.from_string(template) if isinstance(template, str) else None

    def encode(self, text: str, *, add_special_tokens: bool) -> list[int]:
        return list(self._tokenizer.encode(text, add_special_tokens=add_special_tokens).ids)

    def decode(self, token_ids: list[int]) -> str:
        return str(self._tokenizer.decode(token_ids, skip_special_tokens=False))

    def vocab_size(self) -> int:
        return int(self._tokenizer.get_vocab_size(with_added_tokens=True))

    def token_strings(self, token_ids: list[int]) -> list[str]:
        """Each id's vocabulary entry (transformers' ``convert_ids_to_tokens``)."""
        return [self._tokenizer.id_to_token(token) or "" for token in token_ids]

    def render_chat(
        self,
        messages: list[dict[str, Any]],
        rendering: ChatRendering = CHAT_COMPLETION,
        **template_kwargs: Any,
    ) -> str:
        if self._template is None:
            raise InvalidRequest(
                "this model has no chat template; use /v1/completions or serve a model "
                "whose tokenizer_config.json defines chat_template",
                param="messages",
            )
        try:
            text = self._template.render(
                **_free_variables(rendering.template_kwargs),
                messages=messages,
                bos_token=self.bos_token,
                eos_token=self.eos_token,
                add_generation_prompt=rendering.add_generation_prompt,
                **template_kwargs,
            )
        except ChatTemplateError:
            raise
        except TemplateError as exc:
            raise ChatTemplateError(f"chat template failed: {exc}", param="messages") from exc
        return _open_final_message(text, messages) if rendering.continue_final_message else text

    def encode_chat(
        self,
        messages: list[dict[str, Any]],
        rendering: ChatRendering = CHAT_COMPLETION,
        **template_kwargs: Any,
    ) -> list[int]:
        # The template already holds BOS and other special tokens, as in vLLM's server.
        text = self.render_chat(messages, rendering, **template_kwargs)
        return self.encode(text, add_special_tokens=rendering.add_special_tokens)


def _free_variables(template_kwargs: Mapping[str, Any]) -> dict[str, Any]:
    """Those of ``template_kwargs`` that replace nothing the renderer sets (the serving step
    refuses the others with a 400 before this)."""
    return {k: v for k, v in template_kwargs.items() if k not in RESERVED_TEMPLATE_VARIABLES}


def _open_final_message(text: str, messages: list[dict[str, Any]]) -> str:
    """``text`` cut right after the last message's content, as transformers'
    ``continue_final_message`` does (what the template wrote after it goes)."""
    final = messages[-1]["content"] if messages else ""
    if isinstance(final, list):
        texts = [part["text"] for part in final if "text" in part]
        final = texts[-1] if texts else ""
    stripped = final.strip()
    if not stripped or stripped not in text:
        raise InvalidRequest(
            "continue_final_message needs the final message's text in the rendered chat, "
            "and the chat template does not write it there",
            param="messages",
        )
    at = text.rindex(stripped)
    kept = final.lstrip()
    if text[at : at + len(kept)] == kept:
        return text[: at + len(kept)]
    return text[: at + len(stripped)]


def _read_json(path: Path) -> dict[str, Any]:
    if not path.exists():
        return {}
    data = json.loads(path.read_text())
    return data if isinstance(data, dict) else {}


def _token_text(value: Any) -> str:
    if isinstance(value, dict):
        return str(value.get("content", ""))
    return str(value) if value is not None else ""
