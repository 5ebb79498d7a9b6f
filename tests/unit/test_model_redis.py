"""CONVEYOR_MODEL_REDIS_URLS: its syntax, the start-up checks, and which Redis a model is on."""

from __future__ import annotations

import pytest
from fakeredis.aioredis import FakeRedis
from pydantic import ValidationError

from shared.connections.model_redis import ModelRedis, check_served, parse_model_redis_urls
from shared.connections.url import shown_url
from shared.settings import GatewaySettings


def test_entries_are_model_equals_url_separated_by_commas_or_spaces() -> None:
    text = " a=redis://r2:6379/0, b=redis://r3:6379/1\nc=rediss://u:p@r4:6380/0 ,"
    assert parse_model_redis_urls(text) == {
        "a": "redis://r2:6379/0",
        "b": "redis://r3:6379/1",
        "c": "rediss://u:p@r4:6380/0",
    }
    assert parse_model_redis_urls("") == {}


@pytest.mark.parametrize(
    "text", ["a", "a=", "=redis://r:1/0", "a=http://r:1/0", "a=redis://x:1/0,a=redis://y:1/0"]
)
def test_anything_else_is_a_start_up_error_naming_the_entry(text: str) -> None:
    with pytest.raises(ValueError, match="CONVEYOR_MODEL_REDIS_URLS"):
        parse_model_redis_urls(text)
    with pytest.raises(ValidationError, match="CONVEYOR_MODEL_REDIS_URLS"):
        GatewaySettings(model_redis_urls=text)


def test_a_model_that_is_not_served_is_a_start_up_error() -> None:
    check_served({"a": "redis://r2:6379/0"}, {"a", "b"})
    with pytest.raises(ValueError, match="names ghost, not served here"):
        check_served({"ghost": "redis://r2:6379/0"}, {"a", "b"})


def test_one_client_per_distinct_url_and_the_home_one_for_the_rest() -> None:
    opened: list[str] = []

    def connect(url: str) -> FakeRedis:
        opened.append(url)
        return FakeRedis()

    home = "redis://r1:6379/0"
    urls = {"a": "redis://r2:6379/0", "b": "redis://r2:6379/0", "c": home}
    models = ModelRedis(home, urls, connect)
    assert opened == [home, "redis://r2:6379/0"]
    assert models.sharded
    assert models.for_model("a") is models.for_model("b") is not models.home
    assert models.for_model("c") is models.for_model("unlisted") is models.home
    assert models.url_of("c") == models.url_of("unlisted") == home
    assert not ModelRedis(home, {}, connect).sharded


def test_urls_are_shown_without_their_password() -> None:
    assert shown_url("redis://user:secret@r2:6380/3") == "redis://r2:6380/3"


def test_conveyor_up_refuses_several_redis(caplog: pytest.LogCaptureFixture) -> None:
    """`up` starts one Redis and gives every worker CONVEYOR_REDIS_URL: a model mapped
    elsewhere would never see its workers, so it stops before starting anything."""
    from conveyor.cli import run_up
    from shared.settings import Settings

    settings = Settings(model_redis_urls="conveyor-demo=redis://127.0.0.1:1/0")
    assert run_up(settings) == 2
    assert "`conveyor up` runs one Redis" in caplog.text
