"""Tokenizer and chat template of a served model, without torch or transformers.

Reads a Hugging Face model folder's ``tokenizer.json`` (the `tokenizers`
library) and renders its chat template with a sandboxed Jinja environment set
up the way transformers' ``apply_chat_template`` does.
"""

from __future__ import annotations

import json
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

    def render_chat(self, messages: list[dict[str, Any]], **template_kwargs: Any) -> str:
        if self._template is None:
            raise InvalidRequest(
                "this model has no chat template; use /v1/completions or serve a model "
                "whose tokenizer_config.json defines chat_template",
                param="messages",
            )
        try:
            return self._template.render(
                messages=messages,
                bos_token=self.bos_token,
                eos_token=self.eos_token,
                add_generation_prompt=True,
                **template_kwargs,
            )
        except ChatTemplateError:
            raise
        except TemplateError as exc:
            raise ChatTemplateError(f"chat template failed: {exc}", param="messages") from exc

    def encode_chat(self, messages: list[dict[str, Any]], **template_kwargs: Any) -> list[int]:
        # The template already holds BOS and other special tokens, as in vLLM's server.
        return self.encode(self.render_chat(messages, **template_kwargs), add_special_tokens=False)


def _read_json(path: Path) -> dict[str, Any]:
    if not path.exists():
        return {}
    data = json.loads(path.read_text())
    return data if isinstance(data, dict) else {}


def _token_text(value: Any) -> str:
    if isinstance(value, dict):
        return str(value.get("content", ""))
    return str(value) if value is not None else ""
