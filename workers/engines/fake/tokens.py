"""Deterministic token choice: each next token is a function of the whole context so far.

A sequence folds every token (prompt, then output) into a 64-bit state; the next token
is picked from that state (greedy) or from the state mixed with the sequence's seed
(sampled). So greedy output does not depend on the batch, the worker or the process,
and a run resumed from prompt + emitted tokens continues exactly as the uninterrupted
one would. EOS is never chosen: a sequence ends by ``max_tokens`` or a stop token id.
"""

from __future__ import annotations

import os
from collections.abc import Callable, Iterable, Sequence

from shared.protocol import TokenLogprob, TopLogprob

MASK = (1 << 64) - 1
GOLDEN = 0x9E3779B97F4A7C15
LOGPROB_STEP = 0.75
"""How much less likely each next-ranked alternative is (in logprob)."""


def mix64(value: int) -> int:
    """SplitMix64's finalizer: a stable, well-spread 64-bit mix."""
    value = (value + GOLDEN) & MASK
    value = ((value ^ (value >> 30)) * 0xBF58476D1CE4E5B9) & MASK
    value = ((value ^ (value >> 27)) * 0x94D049BB133111EB) & MASK
    return value ^ (value >> 31)


def fold(state: int, token_ids: Iterable[int]) -> int:
    for token in token_ids:
        state = mix64(state ^ ((token + 1) * GOLDEN & MASK))
    return state


class Vocabulary:
    """The token ids the fake engine may produce, and how each one is spelt."""

    def __init__(self, ids: Sequence[int], spell: Callable[[int], str] | None = None) -> None:
        if not ids:
            raise ValueError("the fake engine needs at least one token id it may produce")
        self.ids = list(ids)
        self._spell = spell

    def pick(self, value: int) -> int:
        return self.ids[value % len(self.ids)]

    def spell(self, token_id: int) -> str:
        return self._spell(token_id) if self._spell is not None else ""


class TokenPicker:
    """One sequence's token choice; :meth:`push` every token it emits."""

    def __init__(
        self, vocab: Vocabulary, prompt: Sequence[int], temperature: float, seed: int | None
    ) -> None:
        self._vocab = vocab
        self.state = fold(0, prompt)
        self._salt: int | None = None
        if temperature > 0:
            raw = seed if seed is not None else int.from_bytes(os.urandom(8), "little")
            self._salt = mix64(raw & MASK)

    def next_token(self) -> int:
        if self._salt is None:
            return self._vocab.pick(mix64(self.state))
        return self._vocab.pick(mix64(self.state ^ self._salt))

    def push(self, token_id: int) -> None:
        self.state = fold(self.state, (token_id,))

    def logprob(self, token_id: int, k: int) -> TokenLogprob:
        """The chosen token's logprob and the top ``k`` alternatives (rank order; the
        greedy token is rank 1). Call before :meth:`push`-ing ``token_id``."""
        top_value = -(mix64(self.state ^ 0x5BD1E995) % 1000) / 2000.0
        ranked: list[int] = []
        probe = 0
        while len(ranked) < min(k, len(self._vocab.ids)):
            candidate = self._vocab.pick(mix64(self.state + probe * GOLDEN))
            if candidate not in ranked:
                ranked.append(candidate)
            probe += 1
        values = {tid: top_value - rank * LOGPROB_STEP for rank, tid in enumerate(ranked)}
        greedy = self._vocab.pick(mix64(self.state))
        values.setdefault(greedy, top_value)
        chosen = values.get(token_id, top_value - (k + 1) * LOGPROB_STEP)
        spell = self._vocab.spell
        return TokenLogprob(
            token_id,
            spell(token_id),
            chosen,
            [TopLogprob(tid, spell(tid), values[tid]) for tid in ranked],
        )
