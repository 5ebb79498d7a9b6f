"""Which model folder a process serves: the configured one, or the generated demo model."""

from __future__ import annotations

import logging

from shared.settings import Settings

log = logging.getLogger(__name__)


def resolve_model_path(settings: Settings) -> str:
    """The configured model, or the demo model (generated on first use)."""
    if settings.model:
        return settings.model
    from conveyor.demo_model import DEMO_MODEL_NOTICE, write_demo_model

    path = write_demo_model(settings.demo_model_path())
    log.warning(DEMO_MODEL_NOTICE)
    return str(path.resolve())
