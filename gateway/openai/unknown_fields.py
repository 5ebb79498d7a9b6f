"""Request fields that are not part of OpenAI's schema: accepted (clients such as LangChain
send extras), ignored, and named in the log once per process.

Bounded on every side, since a client picks the names: at most
:data:`MAX_UNKNOWN_FIELDS` per request (more is a 400), at most :data:`MAX_REMEMBERED`
names remembered per process (then one line saying so, and silence), names cut to
:data:`MAX_LOGGED_NAME_CHARS`, and at most one log line per request.
"""

from __future__ import annotations

import logging

from pydantic import BaseModel

from shared.errors import InvalidRequest

log = logging.getLogger(__name__)

MAX_UNKNOWN_FIELDS = 64
"""Unknown top-level fields one request may carry (clients send a handful)."""
MAX_REMEMBERED = 1024
"""Distinct unknown names remembered (and logged) per process."""
MAX_LOGGED_NAME_CHARS = 64
"""A name is remembered and logged cut to this many characters."""


class UnknownFieldLog:
    """Logs each unknown request field name once per process, within the bounds above."""

    def __init__(self, remembered: int = MAX_REMEMBERED) -> None:
        self._seen: set[str] = set()
        self._remembered = remembered
        self._full = False

    def note(self, request: BaseModel) -> None:
        """Refuse a request with too many unknown fields; log the new names in one line."""
        extra = request.model_extra or {}
        if len(extra) > MAX_UNKNOWN_FIELDS:
            raise InvalidRequest(
                f"the request has {len(extra)} fields that are not part of the API; at most "
                f"{MAX_UNKNOWN_FIELDS} unknown fields are accepted",
            )
        if self._full or not extra:
            return
        new = {name[:MAX_LOGGED_NAME_CHARS] for name in extra} - self._seen
        room = self._remembered - len(self._seen)
        logged = sorted(new)[:room]
        self._seen.update(logged)
        if len(logged) < len(new):
            self._full = True
            log.info(
                "ignoring unknown request field(s) %s (each logged once; that makes %d names, "
                "further ones are ignored without a log line)",
                logged,
                self._remembered,
            )
        elif logged:
            log.info("ignoring unknown request field(s) %s (each logged once)", logged)
