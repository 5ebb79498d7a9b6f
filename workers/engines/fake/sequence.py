"""One sequence in the fake engine: its tokens, how far its KV is computed, its stops."""

from __future__ import annotations

import asyncio
from dataclasses import dataclass, field

from shared.protocol import SamplingOptions, TokenLogprob
from workers.engines.fake.kv_cache import BlockTable
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
    table: BlockTable
    prompt_len: int
    computed: int = 0
    """Tokens whose KV is computed (cached hits count)."""
    prefill_end: int = 0
    """Tokens that count as prefill when computed: the prompt, or after a preemption
    everything the sequence had."""
    cached_tokens: int | None = None
    """Prompt tokens found in the prefix cache at the first admission."""
    outputs: asyncio.Queue[Emitted] = field(default_factory=asyncio.Queue)
    finished: bool = False

    @classmethod
    def new(
        cls,
        job_id: str,
        prompt: list[int],
        sampling: SamplingOptions,
        vocab: Vocabulary,
        extra: str | None = None,
    ) -> Sequence:
        picker = TokenPicker(vocab, prompt, sampling.temperature, sampling.seed)
        return cls(job_id, list(prompt), sampling, picker, BlockTable(extra), len(prompt))

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

    def _finish_reason(self, token: int) -> str | None:
        """vLLM's order: a stop token id wins over the length limit."""
        if token in self.sampling.stop_token_ids and self.output_len >= self.sampling.min_tokens:
            return "stop"
        if self.output_len >= self.sampling.max_tokens:
            return "length"
        return None
