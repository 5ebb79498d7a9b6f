"""The gateway's uvicorn configuration."""

from __future__ import annotations

from gateway.server import uvicorn_config
from shared.settings import Settings


def test_access_log_is_off_by_default() -> None:
    assert uvicorn_config(Settings()).access_log is False


def test_access_log_flag_turns_it_on() -> None:
    assert uvicorn_config(Settings(access_log=True)).access_log is True
