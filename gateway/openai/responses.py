"""OpenAI response objects (chat and text completions) built from worker events."""

from __future__ import annotations

import time
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

from gateway.openai import logprob_rows, output_parsing
from gateway.openai.logprob_rows import Echo
from gateway.openai.output_parsing import ChoiceOutput, OutputParser
from shared.protocol import FinishEvent, PromptLogprobs, TokenEvent, TokenLogprob

Json = dict[str, Any]


@dataclass(slots=True)
class ChoiceState:
    index: int
    text: list[str] = field(default_factory=list)
    logprobs: list[TokenLogprob] = field(default_factory=list)
    token_ids: list[int] = field(default_factory=list)
    finish_reason: str | None = None
    prompt_logprobs: PromptLogprobs | None = None


@dataclass(slots=True)
class Usage:
    """Prompt tokens count once per prompt, however many choices share it."""

    choices_per_prompt: int
    prompt_tokens_by_prompt: dict[int, int] = field(default_factory=dict)
    cached_tokens_by_prompt: dict[int, int] = field(default_factory=dict)
    completion_tokens: int = 0

    def add(self, event: FinishEvent) -> None:
        prompt = event.index // self.choices_per_prompt
        self.prompt_tokens_by_prompt[prompt] = event.prompt_tokens
        if event.cached_tokens is not None:
            self.cached_tokens_by_prompt[prompt] = event.cached_tokens
        self.completion_tokens += event.completion_tokens

    def as_json(self) -> Json:
        """OpenAI's usage object; ``prompt_tokens_details.cached_tokens`` where the engine
        reports prefix-cache hits."""
        prompt = sum(self.prompt_tokens_by_prompt.values())
        body: Json = {
            "prompt_tokens": prompt,
            "completion_tokens": self.completion_tokens,
            "total_tokens": prompt + self.completion_tokens,
        }
        if self.cached_tokens_by_prompt:
            cached = sum(self.cached_tokens_by_prompt.values())
            body["prompt_tokens_details"] = {"cached_tokens": cached}
        return body


class ResponseWriter:
    """Shared shape of both endpoints; subclasses fill in the per-endpoint parts."""

    object_name = ""
    chunk_object_name = ""

    def __init__(
        self,
        request_id: str,
        model: str,
        *,
        with_logprobs: bool,
        with_token_ids: bool = False,
        prompt_token_ids: Mapping[int, list[int]] | None = None,
        tokens_as_ids: bool = False,
    ) -> None:
        self.request_id = request_id
        self.tokens_as_ids = tokens_as_ids
        """vLLM's ``return_tokens_as_token_ids``: logprob tokens as ``token_id:N``."""
        self.model = model
        self.created = int(time.time())
        self.with_logprobs = with_logprobs
        self.with_token_ids = with_token_ids
        self.prompt_token_ids = prompt_token_ids or {}
        """Each choice's prompt (``with_token_ids``: vLLM's ``prompt_token_ids`` fields)."""
        self._prompt_sent: set[int] = set()

    def token(self, token_id: int, text: str) -> str:
        return f"token_id:{token_id}" if self.tokens_as_ids else text

    def prompt_logprobs(self, logprobs: PromptLogprobs) -> list[Json | None]:
        return logprob_rows.prompt_logprobs_field(logprobs, self.token)

    def prompt_once(self, index: int) -> list[int] | None:
        """Choice ``index``'s prompt ids the first time a stream asks (token ids wanted)."""
        if not self.with_token_ids or index in self._prompt_sent:
            return None
        self._prompt_sent.add(index)
        return self.prompt_token_ids.get(index)

    def _envelope(self, obj: str, choices: list[Json]) -> Json:
        return {
            "id": self.request_id,
            "object": obj,
            "created": self.created,
            "model": self.model,
            "choices": choices,
        }

    def chunk(self, choices: list[Json]) -> Json:
        return self._envelope(self.chunk_object_name, choices)

    def usage_chunk(self, usage: Usage) -> Json:
        body = self.chunk([])
        body["usage"] = usage.as_json()
        return body

    def response(self, choices: list[ChoiceState], usage: Usage) -> Json:
        body = self._envelope(self.object_name, [self._final(c) for c in choices])
        body["usage"] = usage.as_json()
        return body

    def _final(self, choice: ChoiceState) -> Json:
        body = self.final_choice(choice)
        if self.with_token_ids:
            body["token_ids"] = choice.token_ids
        return body

    def start_chunk(self, index: int) -> Json | None:
        return None

    def delta(self, event: TokenEvent) -> Json | None:
        """The chunk of ``event``; None when it carries nothing to send yet."""
        body = self.delta_chunk(event)
        if body is not None and self.with_token_ids:
            body["choices"][0]["token_ids"] = event.token_ids
        return body

    def delta_chunk(self, event: TokenEvent) -> Json | None:
        raise NotImplementedError

    def finish_chunk(self, index: int, finish_reason: str) -> Json:
        raise NotImplementedError

    def final_choice(self, choice: ChoiceState) -> Json:
        raise NotImplementedError


class ChatWriter(ResponseWriter):
    """Chat completions; with an ``output`` parser, each choice's text is read as
    reasoning, content and tool calls (gateway/openai/output_parsing.py)."""

    object_name = "chat.completion"
    chunk_object_name = "chat.completion.chunk"

    def __init__(
        self,
        request_id: str,
        model: str,
        *,
        with_logprobs: bool,
        with_token_ids: bool = False,
        prompt_token_ids: Mapping[int, list[int]] | None = None,
        output: OutputParser | None = None,
        tokens_as_ids: bool = False,
        echo: str | None = None,
        role: str = "assistant",
    ) -> None:
        super().__init__(
            request_id,
            model,
            with_logprobs=with_logprobs,
            with_token_ids=with_token_ids,
            prompt_token_ids=prompt_token_ids,
            tokens_as_ids=tokens_as_ids,
        )
        self._parser = output
        self._outputs: dict[int, ChoiceOutput] = {}
        self._echo = echo or ""
        """vLLM's chat ``echo``: the last message's text, before each choice's content."""
        self._role = role
        """The answer's role: vLLM's is the last message's with ``add_generation_prompt``
        false (the model continues that turn)."""

    def start_chunk(self, index: int) -> Json:
        """The role chunk; the stream's first one carries the prompt ids (vLLM: one chat
        prompt per request, sent once)."""
        delta = {"role": self._role, "content": self._echo}
        body = self.chunk([_chat_choice(index, delta, None, None)])
        if self.with_token_ids and not self._prompt_sent:
            self._prompt_sent.add(index)
            body["prompt_token_ids"] = self._prompt()
        return body

    def response(self, choices: list[ChoiceState], usage: Usage) -> Json:
        body = super().response(choices, usage)
        if self.with_token_ids:
            body["prompt_token_ids"] = self._prompt()
        scored = next((c.prompt_logprobs for c in choices if c.prompt_logprobs), None)
        if scored is not None:  # vLLM: one chat prompt, its logprobs on the response
            body["prompt_logprobs"] = self.prompt_logprobs(scored)
        return body

    def _prompt(self) -> list[int] | None:
        return next(iter(self.prompt_token_ids.values()), None)

    def delta_chunk(self, event: TokenEvent) -> Json | None:
        logprobs = self._chat_logprobs(event.logprobs or []) if self.with_logprobs else None
        delta: Json = {"content": event.text}
        if self._parser is not None:
            delta = self._output(event.index, self._parser).feed(event.text)
            if not delta and logprobs is None and not self.with_token_ids:
                return None
        return self.chunk([_chat_choice(event.index, delta, logprobs, None)])

    def finish_chunk(self, index: int, finish_reason: str) -> Json:
        delta: Json = {}
        if self._parser is not None:
            output = self._output(index, self._parser)
            delta = output.finish()
            finish_reason = output_parsing.finish_reason(finish_reason, output.made_calls)
        return self.chunk([_chat_choice(index, delta, None, finish_reason)])

    def final_choice(self, choice: ChoiceState) -> Json:
        text = "".join(choice.text)
        message: Json = {"role": "assistant", "content": text}
        reason = choice.finish_reason
        if self._parser is not None:
            parsed = self._parser.parse(text, final=True)
            message = output_parsing.message(parsed)
            if reason is not None:
                reason = output_parsing.finish_reason(reason, bool(parsed.calls))
        message["role"] = self._role
        if self._echo:
            message["content"] = self._echo + (message.get("content") or "")
        logprobs = self._chat_logprobs(choice.logprobs) if self.with_logprobs else None
        body = _chat_choice(choice.index, message, logprobs, reason)
        body["message"] = body.pop("delta")
        return body

    def _output(self, index: int, parser: OutputParser) -> ChoiceOutput:
        output = self._outputs.get(index)
        if output is None:
            output = self._outputs[index] = ChoiceOutput(parser)
        return output

    def _chat_logprobs(self, tokens: list[TokenLogprob]) -> Json:
        return {"content": [self._chat_token(t) for t in tokens], "refusal": None}

    def _chat_token(self, t: TokenLogprob) -> Json:
        token = self.token(t.token_id, t.token)
        return {
            "token": token,
            "logprob": t.logprob,
            "bytes": list(token.encode()),
            "top_logprobs": [
                {"token": name, "logprob": a.logprob, "bytes": list(name.encode())}
                for a in t.top
                for name in (self.token(a.token_id, a.token),)
            ],
        }


class CompletionWriter(ResponseWriter):
    object_name = "text_completion"
    chunk_object_name = "text_completion"

    def __init__(
        self,
        request_id: str,
        model: str,
        *,
        with_logprobs: bool,
        with_token_ids: bool = False,
        prompt_token_ids: Mapping[int, list[int]] | None = None,
        tokens_as_ids: bool = False,
        top_logprobs: int | None = None,
        echo: Mapping[int, Echo] | None = None,
    ) -> None:
        super().__init__(
            request_id,
            model,
            with_logprobs=with_logprobs,
            with_token_ids=with_token_ids,
            prompt_token_ids=prompt_token_ids,
            tokens_as_ids=tokens_as_ids,
        )
        self._text_offsets: dict[int, int] = {}
        self._top = top_logprobs
        """The request's ``logprobs`` (None: every alternative the worker sent)."""
        self._echo = dict(echo or {})
        """Each choice's prompt, written before its text (a stream: in its first chunk)."""
        self._prompt_alone: set[int] = set()
        """Streamed choices that answer their prompt alone (``max_tokens: 0``)."""

    def delta_chunk(self, event: TokenEvent) -> Json | None:
        text = event.text
        rows = logprob_rows.generated(event.logprobs or [], self._top, self.token)
        echo = self._echo.pop(event.index, None)  # a stream echoes each prompt once
        if echo is not None:
            head = logprob_rows.echoed(echo, event.prompt_logprobs, self._top, self.token)
            text, rows = (echo.text, head) if echo.only else (echo.text + text, head + rows)
            if echo.only:
                self._prompt_alone.add(event.index)
        elif event.index in self._prompt_alone:
            return None  # max_tokens 0: the one generated token is dropped
        logprobs = None
        if self.with_logprobs:
            start = self._text_offsets.get(event.index, 0)
            logprobs = logprob_rows.text_logprobs(rows, start)
            self._text_offsets[event.index] = start + len(text)
        choice = _text_choice(event.index, text, logprobs, None)
        prompt = self.prompt_once(event.index)
        if prompt is not None:
            choice["prompt_token_ids"] = prompt
        return self.chunk([choice])

    def finish_chunk(self, index: int, finish_reason: str) -> Json:
        return self.chunk([_text_choice(index, "", None, finish_reason)])

    def final_choice(self, choice: ChoiceState) -> Json:
        text = "".join(choice.text)
        rows = logprob_rows.generated(choice.logprobs, self._top, self.token)
        echo = self._echo.get(choice.index)
        if echo is not None:
            head = logprob_rows.echoed(echo, choice.prompt_logprobs, self._top, self.token)
            text, rows = (echo.text, head) if echo.only else (echo.text + text, head + rows)
        logprobs = logprob_rows.text_logprobs(rows, 0) if self.with_logprobs else None
        body = _text_choice(choice.index, text, logprobs, choice.finish_reason)
        if self.with_token_ids:
            body["prompt_token_ids"] = self.prompt_token_ids.get(choice.index)
        if choice.prompt_logprobs is not None:
            body["prompt_logprobs"] = self.prompt_logprobs(choice.prompt_logprobs)
        return body


def _chat_choice(index: int, delta: Json, logprobs: Json | None, finish: str | None) -> Json:
    return {"index": index, "delta": delta, "logprobs": logprobs, "finish_reason": finish}


def _text_choice(index: int, text: str, logprobs: Json | None, finish: str | None) -> Json:
    return {"index": index, "text": text, "logprobs": logprobs, "finish_reason": finish}
