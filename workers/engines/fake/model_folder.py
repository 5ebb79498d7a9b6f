"""What the fake engine reads of a model folder: ``config.json`` (vocabulary size,
context length, EOS ids, hidden size) and ``tokenizer.json`` to spell its tokens.
It never loads weights."""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

DEFAULT_MAX_MODEL_LEN = 2048


@dataclass(frozen=True, slots=True)
class ModelShape:
    vocab_size: int
    max_model_len: int
    eos_ids: frozenset[int]
    hidden_size: int
    tokenizer: Any | None
    """A ``tokenizers.Tokenizer`` (None: the folder has no tokenizer.json)."""

    def producible_ids(self) -> list[int]:
        """Ids the engine may emit: ordinary tokens, never EOS or an added/special one."""
        excluded = set(self.eos_ids)
        limit = self.vocab_size
        if self.tokenizer is not None:
            excluded.update(self.tokenizer.get_added_tokens_decoder())
            limit = min(limit, int(self.tokenizer.get_vocab_size(with_added_tokens=True)))
        return [i for i in range(limit) if i not in excluded]


def read_model_folder(path: str) -> ModelShape:
    folder = Path(path)
    config_file = folder / "config.json"
    if not config_file.is_file():
        raise ValueError(f"the fake engine needs a model folder with config.json: {path}")
    config: dict[str, Any] = json.loads(config_file.read_text())
    text = config.get("text_config") or {}
    vocab = int(config.get("vocab_size") or text.get("vocab_size") or 0)
    positions = config.get("max_position_embeddings") or text.get("max_position_embeddings")
    hidden = int(config.get("hidden_size") or text.get("hidden_size") or 384)
    return ModelShape(
        vocab_size=vocab,
        max_model_len=int(positions or DEFAULT_MAX_MODEL_LEN),
        eos_ids=frozenset(_ids(config.get("eos_token_id"))),
        hidden_size=hidden,
        tokenizer=_tokenizer(folder),
    )


def _ids(value: Any) -> list[int]:
    if value is None:
        return []
    return [int(v) for v in value] if isinstance(value, list) else [int(value)]


def _tokenizer(folder: Path) -> Any | None:
    file = folder / "tokenizer.json"
    if not file.is_file():
        return None
    from tokenizers import Tokenizer

    return Tokenizer.from_file(str(file))
