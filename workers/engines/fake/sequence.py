"""One sequence in the fake engine: its tokens, how far its KV is computed, its stops."""

from __future__ import annotations

import asyncio
from dataclasses import dataclass, field
from typing import Any

from shared.protocol import SamplingOptions, TokenLogprob
from workers.engines.base import StepOutput
from workers.engines.fake.kv_cache import BlockTable
from workers.engines.fake.text import TextStream
from workers.engines.fake.tokens import TokenPicker, Vocabulary


@dataclass(frozen=True, slots=True)
class Emitted:
    """What one step gave a sequence: a token, or only its end (an abort)."""

    token_id: int | None
    logprob: TokenLogprob | None
    finish_reason: str | None


@dataclass(eq=False)
class Sequence:
    job_id: str
    token_ids: list[int]
    """Prompt, then every output token."""
    sampling: SamplingOptions
    picker: TokenPicker
    text: TextStream
    table: BlockTable
    prompt_len: int
    computed: int = 0
    """Tokens whose KV is computed (cached hits count)."""
    prefill_end: int = 0
    """Tokens that count as prefill when computed: the prompt, or after a preemption
    everything the sequence had."""
    cached_tokens: int | None = None
    """Prompt tokens found in the prefix cache at the first admission."""
    outputs: asyncio.Queue[StepOutput] = field(default_factory=asyncio.Queue)
    """Where the sequence's outputs wait for its consumer."""
    finished: bool = False

    @classmethod
    def new(
        cls,
        job_id: str,
        prompt: list[int],
        sampling: SamplingOptions,
        vocab: Vocabulary,
        tokenizer: Any | None = None,
        extra: str | None = None,
    ) -> Sequence:
        picker = TokenPicker(vocab, prompt, sampling.temperature, sampling.seed)
        text = TextStream(tokenizer, sampling.stop, sampling.skip_special_tokens)
        return cls(job_id, list(prompt), sampling, picker, text, BlockTable(extra), len(prompt))

    @property
    def output_len(self) -> int:
        return len(self.token_ids) - self.prompt_len

    def to_compute(self) -> int:
        return len(self.token_ids) - self.computed

    def prefill_tokens(self, tokens: int) -> int:
        """How many of the next ``tokens`` computed are prefill (the rest decode)."""
        return max(0, min(self.computed + tokens, self.prefill_end) - self.computed)

    def sample(self) -> Emitted:
        """The next token, once every token so far is computed."""
        token = self.picker.next_token()
        k = self.sampling.logprobs
        logprob = self.picker.logprob(token, k) if k is not None else None
        self.picker.push(token)
        self.token_ids.append(token)
        return Emitted(token, logprob, self._finish_reason(token))

    def output(self, emitted: Emitted) -> StepOutput:
        """The step's output for the consumer: its text, cut at a stop string (which ends
        the sequence, as in vLLM)."""
        tokens = [] if emitted.token_id is None else [emitted.token_id]
        text = self.text.delta(tokens)
        finish_reason = emitted.finish_reason
        if self.text.stopped and finish_reason is None:
            finish_reason = "stop"
        logprobs: list[TokenLogprob] | None = None
        if self.sampling.logprobs is not None:
            logprobs = [] if emitted.logprob is None else [emitted.logprob]
        return StepOutput(
            token_ids=tokens,
            text=text,
            logprobs=logprobs,
            finish_reason=finish_reason,
            prompt_tokens=self.prompt_len,
            cached_tokens=self.cached_tokens,
        )

    def _finish_reason(self, token: int) -> str | None:
        """vLLM's order: a stop token id wins over the length limit."""
        if token in self.sampling.stop_token_ids and self.output_len >= self.sampling.min_tokens:
            return "stop"
        if self.output_len >= self.sampling.max_tokens:
            return "length"
        return None
