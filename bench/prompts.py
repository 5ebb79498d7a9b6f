"""Request bodies whose prompts have an exact token count.

Chat prompts are rendered with the model's own chat template and tokenizer (the same
code path as Conveyor's gateway; vLLM renders the same template with transformers) and
padded with words that are one token each until the rendered prompt has exactly the
wanted number of tokens. Completion prompts are token-id lists. Every request gets its
own random words, so no two prompts share more than the template's first few tokens
(prefix caching cannot skip the prefill).
"""

from __future__ import annotations

import random
import re
from pathlib import Path
from typing import Any, Literal

from gateway.catalog.tokenizer import ModelTokenizer

Endpoint = Literal["chat", "completions"]

_WORD = re.compile(r"^\u0120[a-z]{3,10}$")  # byte-level BPE: \u0120 is a leading space
_MAX_ADJUST = 20


class PromptFactory:
    def __init__(self, model_dir: Path, model_name: str, endpoint: Endpoint) -> None:
        self._tokenizer = ModelTokenizer(model_dir)
        self._model = model_name
        self.endpoint: Endpoint = endpoint
        self._words = self._one_token_words()
        if len(self._words) < 50:
            raise RuntimeError(f"too few one-token words in the tokenizer of {model_dir}")

    @property
    def words(self) -> list[str]:
        """Words that are one token each, with their leading space."""
        return [text for text, _ in self._words]

    @property
    def path(self) -> str:
        return "/v1/chat/completions" if self.endpoint == "chat" else "/v1/completions"

    def describe(self, input_tokens: int) -> str:
        if self.endpoint == "chat":
            return (
                f"chat messages rendered to exactly {input_tokens} prompt tokens "
                "(model's chat template; checked against usage.prompt_tokens)"
            )
        return f"/v1/completions with {input_tokens} prompt token ids (exact)"

    def body(self, key: int, input_tokens: int, output_tokens: int) -> dict[str, Any]:
        """The request body for request number ``key`` (same key, same prompt)."""
        rng = random.Random(key)
        body: dict[str, Any] = {
            "model": self._model,
            "max_tokens": output_tokens,
            "temperature": 0,
            "ignore_eos": True,
            "stream": True,
            "stream_options": {"include_usage": True},
        }
        if self.endpoint == "chat":
            body["messages"] = [{"role": "user", "content": self._chat_text(rng, input_tokens)}]
        else:
            body["prompt"] = [rng.choice(self._words)[1] for _ in range(input_tokens)]
        return body

    def _chat_text(self, rng: random.Random, input_tokens: int) -> str:
        words = [rng.choice(self._words)[0] for _ in range(input_tokens)]
        count = input_tokens
        for _ in range(_MAX_ADJUST):
            text = "".join(words[:count]).lstrip()
            got = len(self._tokenizer.encode_chat([{"role": "user", "content": text}]))
            if got == input_tokens:
                return text
            count += input_tokens - got
            if count < 1:
                break
            while len(words) < count:
                words.append(rng.choice(self._words)[0])
        raise RuntimeError(f"cannot build a chat prompt of exactly {input_tokens} tokens")

    def _one_token_words(self) -> list[tuple[str, int]]:
        """(" word", token id) pairs whose text encodes back to that one token."""
        vocab: dict[str, int] = self._tokenizer._tokenizer.get_vocab()
        words: list[tuple[str, int]] = []
        for piece, token_id in sorted(vocab.items(), key=lambda item: item[1]):
            if not _WORD.match(piece):
                continue
            text = " " + piece[1:]
            if self._tokenizer.encode(text, add_special_tokens=False) == [token_id]:
                words.append((text, token_id))
        return words
