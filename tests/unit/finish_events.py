"""Comparing a worker's finish event with an expected one, whatever its start time."""

from __future__ import annotations

import msgspec

from shared.protocol import Event


def unstamped(event: Event) -> Event:
    """``event`` without the worker's start time (a wall-clock reading): a finish event
    a worker wrote carries one, and the test checks it apart."""
    started = getattr(event, "started_unix", None)
    assert started is None or started > 0
    if started is None:
        return event
    return msgspec.structs.replace(event, started_unix=None)
