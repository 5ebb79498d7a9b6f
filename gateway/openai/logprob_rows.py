"""Logprobs as vLLM's server writes them: a text completion's rows (``echo``'d prompt
tokens first, then the generated ones) and the ``prompt_logprobs`` field."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from shared.protocol import PromptLogprob, PromptLogprobs, TokenLogprob

Json = dict[str, Any]
Row = tuple[str, float | None, dict[str, float] | None]
"""One token of a completion's logprobs: its text, logprob and alternatives."""
Namer = Callable[[int, str], str]
"""A token's text from its id and decoded text (``return_tokens_as_token_ids``)."""


@dataclass(frozen=True, slots=True)
class Echo:
    """A completion's prompt as ``echo`` writes it: its text and its first token (which
    has no logprob: nothing precedes it)."""

    text: str
    first_token: str
    first_token_id: int
    only: bool = False
    """``max_tokens: 0``: the prompt alone, the one generated token dropped."""


def generated(tokens: list[TokenLogprob], top: int | None, name: Namer) -> list[Row]:
    """vLLM's shape: the sampled token's logprob, then up to ``top`` alternatives
    (``logprobs: 0``: the sampled token alone; None: every one the worker sent)."""
    rows: list[Row] = []
    for t in tokens:
        alternatives = {name(t.token_id, t.token): t.logprob}
        for a in t.top[:top]:
            alternatives.setdefault(name(a.token_id, a.token), a.logprob)
        rows.append((name(t.token_id, t.token), t.logprob, alternatives))
    return rows


def echoed(echo: Echo, scored: PromptLogprobs | None, top: int | None, name: Namer) -> list[Row]:
    """The prompt's rows: its first token without a logprob, then each token scored."""
    first: Row = (name(echo.first_token_id, echo.first_token), None, None)
    return [first, *(_prompt_row(entries, top, name) for entries in (scored or [])[1:])]


def _prompt_row(entries: list[PromptLogprob] | None, top: int | None, name: Namer) -> Row:
    if not entries:
        return ("", None, None)
    own = entries[0]
    kept = entries if top is None else entries[: top + 1]
    return (
        name(own.token_id, own.token),
        own.logprob,
        {name(e.token_id, e.token): e.logprob for e in kept},
    )


def text_logprobs(rows: list[Row], offset: int) -> Json:
    """A completion's ``logprobs`` object; ``offset``: where the first token's text starts."""
    text_offset = []
    for token, _, _ in rows:
        text_offset.append(offset)
        offset += len(token)
    return {
        "tokens": [token for token, _, _ in rows],
        "token_logprobs": [logprob for _, logprob, _ in rows],
        "top_logprobs": [alternatives for _, _, alternatives in rows],
        "text_offset": text_offset,
    }


def prompt_logprobs_field(logprobs: PromptLogprobs, name: Namer) -> list[Json | None]:
    """vLLM's ``prompt_logprobs`` field: per position, token id -> its logprob."""
    return [
        None
        if entries is None
        else {
            str(e.token_id): {
                "logprob": e.logprob,
                "rank": e.rank,
                "decoded_token": name(e.token_id, e.token),
            }
            for e in entries
        }
        for entries in logprobs
    ]
