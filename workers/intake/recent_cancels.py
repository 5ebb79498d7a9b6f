"""Cancels this worker heard of lately, for the jobs whose start raced their cancel.

A client's cancel is published once. A job still being leased when it lands has no
task to cancel yet; the runtime checks here just before it starts the task.
"""

from __future__ import annotations

import time


class RecentCancels:
    """Request ids cancelled in the last minute, for jobs whose start raced the cancel."""

    def __init__(self, keep_s: float = 60.0) -> None:
        self._keep_s = keep_s
        self._at: dict[str, float] = {}

    def add(self, request_id: str) -> None:
        now = time.monotonic()
        self._at[request_id] = now
        if len(self._at) > 1024:
            self._at = {r: t for r, t in self._at.items() if now - t < self._keep_s}

    def holds(self, request_id: str) -> bool:
        at = self._at.get(request_id)
        return at is not None and time.monotonic() - at < self._keep_s
