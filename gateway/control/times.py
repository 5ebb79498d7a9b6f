"""Times as people type them: ``30d`` (a duration), ``2025-06-01``, ISO 8601, unix seconds.

Shared by /admin/* and the ``conveyor`` CLI, so both accept the same spellings.
Errors are InvalidRequest naming the field.
"""

from __future__ import annotations

import math
import re
from datetime import UTC, datetime, timedelta

from shared.errors import InvalidRequest

_DURATION = re.compile(r"(\d+(?:\.\d+)?)\s*([smhdw])")
_UNITS_S = {"s": 1, "m": 60, "h": 3600, "d": 86400, "w": 7 * 86400}


def parse_duration(text: str, *, param: str) -> timedelta:
    """``90s``, ``15m``, ``12h``, ``30d``, ``2w``."""
    match = _DURATION.fullmatch(text.strip().lower())
    if match is None or float(match.group(1)) <= 0:
        raise InvalidRequest(
            f"{param}: {text!r} is not a duration such as 90s, 15m, 12h, 30d or 2w", param=param
        )
    try:
        return timedelta(seconds=float(match.group(1)) * _UNITS_S[match.group(2)])
    except OverflowError:
        raise _out_of_range(text, param) from None


def parse_instant(text: str, *, param: str, now: datetime, ago: bool = True) -> datetime:
    """An aware UTC datetime from ISO 8601 (a date or a datetime; no zone means UTC), unix
    seconds, or a duration counted back from ``now`` (forward when ``ago`` is False)."""
    value = text.strip()
    if _DURATION.fullmatch(value.lower()):
        delta = parse_duration(value, param=param)
        try:
            return now - delta if ago else now + delta
        except OverflowError:
            raise _out_of_range(text, param) from None
    try:
        seconds = float(value)
    except ValueError:
        pass
    else:
        if not math.isfinite(seconds) or seconds < 0:
            raise InvalidRequest(f"{param}: {text!r} is not a time", param=param)
        try:
            return datetime.fromtimestamp(seconds, UTC)
        except (OverflowError, OSError, ValueError):
            raise _out_of_range(text, param) from None
    try:
        parsed = datetime.fromisoformat(value.replace("Z", "+00:00").replace("z", "+00:00"))
    except ValueError:
        raise InvalidRequest(
            f"{param}: {text!r} is not a time (ISO 8601 such as 2025-06-01 or "
            "2025-06-01T12:00:00Z, unix seconds, or a duration such as 7d)",
            param=param,
        ) from None
    return parsed.replace(tzinfo=UTC) if parsed.tzinfo is None else parsed.astimezone(UTC)


def _out_of_range(text: str, param: str) -> InvalidRequest:
    return InvalidRequest(f"{param}: {text[:64]!r} is out of range", param=param)
