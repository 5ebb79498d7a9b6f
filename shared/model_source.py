"""Which model folder a process serves: the configured one, or the generated demo model."""

from __future__ import annotations

import logging

from shared.settings import ImageSettings

log = logging.getLogger(__name__)


def resolve_model_path(settings: ImageSettings) -> str:
    """The configured model, or the demo model (generated on first use)."""
    if settings.model:
        return settings.model
    from shared.demo_model import DEMO_MODEL_NOTICE, write_demo_model

    kind = demo_kind(settings)
    path = write_demo_model(settings.demo_model_path(kind), kind=kind)
    log.warning(DEMO_MODEL_NOTICE)
    return str(path.resolve())


def demo_kind(settings: ImageSettings) -> str:
    """An encode worker needs a vision-language model: the demo is then a tiny LLaVA."""
    return "llava" if settings.encode else "llama"
