"""Which model folder the processes serve: the configured one, or the generated demo model.

Only the CLI resolves the demo model; the gateway and the workers are always handed a
model folder (or a hub id) in ``CONVEYOR_MODEL``.
"""

from __future__ import annotations

import logging

from shared.settings import Settings

log = logging.getLogger(__name__)


def with_model(settings: Settings) -> Settings:
    """The settings, with the demo model (generated on first use) when none is configured."""
    if settings.model is not None:
        return settings
    from shared.demo.model import DEMO_MODEL_NOTICE, write_demo_model

    kind = demo_kind(settings)
    path = write_demo_model(settings.demo_model_path(kind), kind=kind)
    log.warning(DEMO_MODEL_NOTICE)
    return settings.model_copy(
        update={"model": str(path.resolve()), "served_model_name": settings.served_name()}
    )


def demo_kind(settings: Settings) -> str:
    """An encode worker needs a vision-language model: the demo is then a tiny LLaVA."""
    return "llava" if settings.encode else "llama"
