"""Times as people type them (shared by /admin/usage and the CLI)."""

from __future__ import annotations

from datetime import UTC, datetime, timedelta

import pytest

from gateway.control.times import parse_duration, parse_instant
from shared.errors import InvalidRequest

NOW = datetime(2025, 6, 10, 12, 0, tzinfo=UTC)


def test_durations() -> None:
    assert parse_duration("30d", param="x") == timedelta(days=30)
    assert parse_duration(" 1.5h ", param="x") == timedelta(minutes=90)
    for bad in ("", "0d", "d", "5y", "-1d"):
        with pytest.raises(InvalidRequest):
            parse_duration(bad, param="x")


@pytest.mark.parametrize(
    ("text", "expected"),
    [
        ("7d", NOW - timedelta(days=7)),
        ("2025-06-01", datetime(2025, 6, 1, tzinfo=UTC)),
        ("2025-06-01T10:00:00Z", datetime(2025, 6, 1, 10, tzinfo=UTC)),
        ("2025-06-01T12:00:00+02:00", datetime(2025, 6, 1, 10, tzinfo=UTC)),
        ("1748736000", datetime(2025, 6, 1, tzinfo=UTC)),
    ],
)
def test_instants(text: str, expected: datetime) -> None:
    assert parse_instant(text, param="since", now=NOW) == expected


def test_forward_durations_and_errors() -> None:
    assert parse_instant("30d", param="e", now=NOW, ago=False) == NOW + timedelta(days=30)
    for bad in ("yesterday", "-5", "nan", "inf"):
        with pytest.raises(InvalidRequest) as caught:
            parse_instant(bad, param="since", now=NOW)
        assert caught.value.param == "since"


@pytest.mark.parametrize("text", ["99999999999d", "9" * 400 + "w", "99999999999999", "1e300"])
def test_times_out_of_range_are_invalid_requests(text: str) -> None:
    with pytest.raises(InvalidRequest, match="out of range") as caught:
        parse_instant(text, param="since", now=NOW)
    assert caught.value.param == "since"
