"""Prompts given as text or as token ids -> token lists, checked against the model."""

from __future__ import annotations

from collections.abc import Iterable, Sequence

from gateway.catalog.served_models import ServedModel
from gateway.serving import limits
from shared.errors import InvalidRequest


def token_lists(
    prompts: Sequence[str | list[int]], model: ServedModel, name: str, *, indexed: bool
) -> list[list[int]]:
    """Each prompt as token ids: text tokenized with the model's special tokens, token ids
    checked against its vocabulary. Empty, or too long to ever fit, is a 400."""
    limits.check_prompts_fit(prompts, model, name, indexed=indexed)
    found: list[list[int]] = []
    for position, prompt in enumerate(prompts):
        param = f"{name}[{position}]" if indexed else name
        if not prompt:
            raise InvalidRequest(f"{param} must not be empty", param=param)
        if isinstance(prompt, str):
            found.append(model.tokenizer.encode(prompt, add_special_tokens=True))
        else:
            check_vocabulary(prompt, model, param)
            found.append(list(prompt))
    return found


def check_vocabulary(token_ids: Iterable[int], model: ServedModel, param: str) -> None:
    """Every token id names a token of the model's vocabulary."""
    size = model.tokenizer.vocab_size()
    bad = sorted({token for token in token_ids if not 0 <= token < size})
    if bad:
        raise InvalidRequest(
            f"{param} holds token id(s) {bad[:5]} outside the vocabulary of `{model.name}` "
            f"(0..{size - 1})",
            param=param,
        )
