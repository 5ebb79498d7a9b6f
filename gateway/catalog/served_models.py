"""The models this gateway serves: name, kind, tokenizer and context window; and the LoRA
adapters registered for them, each served under its own name (as vLLM's server does)."""

from __future__ import annotations

import dataclasses
import json
import time
from collections.abc import Iterable
from dataclasses import dataclass
from enum import StrEnum
from pathlib import Path
from typing import Any

from gateway.catalog.tokenizer import ModelTokenizer
from gateway.openai.output_formats import NO_FORMATS, OutputFormats, detect
from shared.errors import InvalidRequest, ModelNotFound, WrongModelKind
from shared.queue.lora_registry import LoraSpec

DEFAULT_MAX_MODEL_LEN = 2048


class ModelKind(StrEnum):
    GENERATE = "generate"
    """Chat and text completions."""
    EMBED = "embed"
    """/v1/embeddings."""


@dataclass(frozen=True, slots=True)
class ServedModel:
    name: str
    path: str
    tokenizer: ModelTokenizer
    max_model_len: int
    created_unix: int
    kind: ModelKind = ModelKind.GENERATE
    image_token_id: int | None = None
    """The (unexpanded) image placeholder of a vision-language model; None: text only."""
    output_formats: OutputFormats = NO_FORMATS
    """The tool-call and reasoning formats it writes (gateway/openai/output_formats.py)."""
    parent: str | None = None
    """A LoRA adapter: its base model (``path`` is the adapter's folder); None: a model."""

    @property
    def base(self) -> str:
        """The model whose workers run it: itself, or an adapter's base model."""
        return self.parent or self.name

    @property
    def adapter(self) -> str | None:
        """The LoRA adapter a request for this name runs with (None: the base model)."""
        return self.name if self.parent is not None else None

    def require(self, kind: ModelKind) -> ServedModel:
        """This model, if it serves ``kind`` requests; else a 400 that says where to go."""
        if self.kind is kind:
            return self
        if self.kind is ModelKind.EMBED:
            what, use = "an embedding model", "/v1/embeddings"
        else:
            what, use = "a text generation model", "/v1/chat/completions or /v1/completions"
        raise WrongModelKind(f"`{self.name}` is {what}: send it to {use}", param="model")


class ModelCatalog:
    def __init__(self, models: list[ServedModel]) -> None:
        self._models = {model.name: model for model in models}
        self._adapters: dict[str, ServedModel] = {}

    @classmethod
    def load(
        cls,
        name: str,
        path: str,
        max_model_len: int | None,
        parsers: tuple[str, str] = ("auto",) * 2,
    ) -> ModelCatalog:
        """``parsers``: the tool_call_parser and reasoning_parser settings."""
        return cls([load_model(name, path, max_model_len, parsers=parsers)])

    def add(self, model: ServedModel) -> None:
        if model.name in self._models:
            raise ValueError(f"two served models are named {model.name!r}")
        self._models[model.name] = model

    def set_adapters(self, base: str, specs: Iterable[LoraSpec]) -> None:
        """The registered adapters of ``base`` (replacing those known before)."""
        model = self._models.get(base)
        kept = {name: m for name, m in self._adapters.items() if m.parent != base}
        if model is not None and model.kind is ModelKind.GENERATE:
            for spec in specs:
                if spec.name not in self._models:
                    kept[spec.name] = dataclasses.replace(
                        model, name=spec.name, path=spec.path, parent=base
                    )
        self._adapters = kept

    def drop_adapter(self, name: str) -> None:
        self._adapters = {n: m for n, m in self._adapters.items() if n != name}

    def bases(self) -> list[str]:
        """The text generation models: those adapters can be registered for."""
        return [m.name for m in self._models.values() if m.kind is ModelKind.GENERATE]

    def get(self, name: str, allowed: frozenset[str] | None = None) -> ServedModel:
        """The model or adapter ``name``; with ``allowed`` (an API key's models) any other
        does not exist, and the error lists only the allowed ones."""
        model = self._models.get(name) or self._adapters.get(name)
        if model is None or (allowed is not None and name not in allowed):
            every = [*self._models, *self._adapters]
            known = ", ".join(m for m in sorted(every) if allowed is None or m in allowed)
            known = known or "none"
            raise ModelNotFound(
                f"The model `{shown_name(name)}` does not exist. Models served here: {known}.",
                param="model",
            )
        return model

    def all(self) -> list[ServedModel]:
        """The models (not the adapters)."""
        return list(self._models.values())

    def adapters(self) -> list[ServedModel]:
        return sorted(self._adapters.values(), key=lambda m: m.name)


def load_model(
    name: str,
    path: str,
    max_model_len: int | None,
    kind: ModelKind = ModelKind.GENERATE,
    parsers: tuple[str, str] = ("auto", "auto"),
) -> ServedModel:
    folder = _local_folder(path)
    tokenizer = ModelTokenizer(folder)
    return ServedModel(
        name=name,
        path=path,
        tokenizer=tokenizer,
        max_model_len=max_model_len or _context_window(folder),
        created_unix=int(time.time()),
        kind=kind,
        image_token_id=_image_token_id(folder),
        output_formats=detect(tokenizer.template_source, *parsers),
    )


def _local_folder(path: str) -> Path:
    folder = Path(path)
    if folder.is_dir():
        return folder
    try:
        from huggingface_hub import snapshot_download

        return Path(snapshot_download(path, allow_patterns=["*.json", "*.jinja"]))
    except Exception as exc:
        raise InvalidRequest(f"cannot find the model files of {path!r}: {exc}") from exc


def _config(folder: Path) -> dict[str, Any]:
    config_file = folder / "config.json"
    if not config_file.exists():
        return {}
    config = json.loads(config_file.read_text())
    return config if isinstance(config, dict) else {}


def _image_token_id(folder: Path) -> int | None:
    """LLaVA names it ``image_token_index``, Qwen2-VL ``image_token_id``."""
    config = _config(folder)
    if "vision_config" not in config:
        return None
    for name in ("image_token_id", "image_token_index"):
        if isinstance(config.get(name), int):
            return int(config[name])
    return None


def _context_window(folder: Path) -> int:
    config = _config(folder)
    if not config:
        return DEFAULT_MAX_MODEL_LEN
    text_config = config.get("text_config", config)
    value = text_config.get("max_position_embeddings") or config.get("max_position_embeddings")
    return int(value) if value else DEFAULT_MAX_MODEL_LEN


def shown_name(name: str, max_chars: int = 64) -> str:
    """A client-sent name as echoed in an error: cut to ``max_chars``."""
    return name if len(name) <= max_chars else f"{name[:max_chars]}..."
