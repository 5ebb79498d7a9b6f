"""Request fields that are not part of OpenAI's schema: accepted (clients such as LangChain
send extras), ignored, and named in the log once per process."""

from __future__ import annotations

import logging

from pydantic import BaseModel

log = logging.getLogger(__name__)


class UnknownFieldLog:
    """Logs each unknown request field name once per process."""

    def __init__(self) -> None:
        self._seen: set[str] = set()

    def note(self, request: BaseModel) -> None:
        for name in (request.model_extra or {}).keys() - self._seen:
            self._seen.add(name)
            log.info("ignoring unknown request field %r (logged once)", name)
