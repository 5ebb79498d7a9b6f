"""shared/connections/url.py: the ``redis+sentinel://`` grammar, and which client each URL gets."""

from __future__ import annotations

import logging
import re
from pathlib import Path

import pytest
import redis
from hypothesis import given
from hypothesis import strategies as st
from redis.asyncio.sentinel import SentinelConnectionPool as AsyncSentinelPool
from redis.sentinel import SentinelConnectionPool

from shared.connections.connect import BoundedSentinelConnectionPool, connect, db_of
from shared.connections.url import (
    DEFAULT_SENTINEL_PORT,
    SentinelUrl,
    async_client,
    is_sentinel_url,
    parse_sentinel_url,
    sync_client,
)


def test_the_issue_example() -> None:
    parsed = parse_sentinel_url("redis+sentinel://h1:26379,h2:26379,h3:26379/mymaster/0")
    assert parsed == SentinelUrl(
        sentinels=(("h1", 26379), ("h2", 26379), ("h3", 26379)),
        service_name="mymaster",
        db=0,
    )


def test_defaults_credentials_and_options() -> None:
    parsed = parse_sentinel_url(
        "REDIS+SENTINEL://app:p%40ss@s1,s2:26380,[::1]:26381/conveyor/"
        "?sentinel_password=s3cret&sentinel_username=watch"
    )
    assert parsed.sentinels == (("s1", DEFAULT_SENTINEL_PORT), ("s2", 26380), ("::1", 26381))
    assert (parsed.service_name, parsed.db) == ("conveyor", 0)
    assert (parsed.username, parsed.password) == ("app", "p@ss")
    assert (parsed.sentinel_username, parsed.sentinel_password) == ("watch", "s3cret")
    assert str(parsed) == "redis+sentinel://s1:26379,s2:26380,[::1]:26381/conveyor/0"


def test_a_password_alone() -> None:
    parsed = parse_sentinel_url("redis+sentinel://:pw@s1/m/3")
    assert (parsed.username, parsed.password, parsed.db) == (None, "pw", 3)


@pytest.mark.parametrize(
    ("url", "problem"),
    [
        ("redis://h:6379/0", "not a redis+sentinel"),
        ("redis+sentinel://h1:26379", "names the master"),
        ("redis+sentinel://h1:26379/", "names the master"),
        ("redis+sentinel://h1/m/x", "is a number"),
        ("redis+sentinel://h1/m/-1", "not negative"),
        ("redis+sentinel://h1/m/0/extra", "/<service_name>[/<db>]"),
        ("redis+sentinel://h1,,h2/m", "host[:port],host[:port]"),
        ("redis+sentinel://:26379/m", "has a host"),
        ("redis+sentinel://h1:port/m", "bad port"),
        ("redis+sentinel://h1:70000/m", "bad port"),
        ("redis+sentinel://[::1/m", "bad Sentinel address"),
        ("redis+sentinel://h1/m?socket_timeout=1", "unknown redis+sentinel:// option"),
    ],
)
def test_bad_urls_say_what_is_wrong(url: str, problem: str) -> None:
    with pytest.raises(ValueError, match=re.escape(problem)):
        parse_sentinel_url(url)


def test_only_the_sentinel_scheme_is_sentinel() -> None:
    assert is_sentinel_url("redis+sentinel://h/m")
    assert not is_sentinel_url("redis://h:6379/0")
    assert not is_sentinel_url("rediss://h:6379/0")
    assert not is_sentinel_url("unix:///tmp/redis.sock")


hosts = st.from_regex(r"[a-z][a-z0-9-]{0,10}(\.[a-z0-9-]{1,8}){0,2}", fullmatch=True)


@given(
    sentinels=st.lists(st.tuples(hosts, st.integers(1, 65535)), min_size=1, max_size=5),
    service=st.from_regex(r"[A-Za-z0-9_.-]{1,20}", fullmatch=True),
    db=st.integers(0, 15),
)
def test_printing_then_parsing_gives_the_same_address(
    sentinels: list[tuple[str, int]], service: str, db: int
) -> None:
    parsed = SentinelUrl(sentinels=tuple(sentinels), service_name=service, db=db)
    assert parse_sentinel_url(str(parsed)) == parsed


def test_a_plain_url_gets_redis_pys_own_clients() -> None:
    client = sync_client("redis://127.0.0.1:6390/4", timeout_s=1.0, connect_timeout_s=0.5)
    kwargs = client.connection_pool.connection_kwargs
    assert (kwargs["port"], kwargs["db"], kwargs["socket_timeout"]) == (6390, 4, 1.0)
    assert type(client.connection_pool) is redis.ConnectionPool
    client.close()


async def test_a_sentinel_url_gets_sentinel_pools_with_the_nodes_settings() -> None:
    url = "redis+sentinel://:pw@127.0.0.1:1,127.0.0.1:2/conveyor/5?sentinel_password=sp"
    sync = sync_client(url, timeout_s=1.0, connect_timeout_s=0.5)
    assert isinstance(sync.connection_pool, SentinelConnectionPool)
    assert sync.connection_pool.connection_kwargs["db"] == 5
    assert sync.connection_pool.connection_kwargs["password"] == "pw"
    sentinels = sync.connection_pool.sentinel_manager.sentinels
    assert [s.connection_pool.connection_kwargs["password"] for s in sentinels] == ["sp", "sp"]
    sync.close()
    cli = async_client(url, timeout_s=1.0, connect_timeout_s=0.5)
    assert isinstance(cli.connection_pool, AsyncSentinelPool)
    await cli.aclose()
    pooled = connect(url, max_connections=7)
    pool = pooled.connection_pool
    assert isinstance(pool, BoundedSentinelConnectionPool)
    assert (pool.max_connections, db_of(pooled)) == (7, 5)
    assert pool.service_name == "conveyor" and pool.is_master
    await pooled.aclose()


def test_per_model_urls_may_be_sentinel_urls_with_their_own_commas() -> None:
    from shared.connections.model_redis import parse_model_redis_urls

    sentinel = "redis+sentinel://:pw@h1:26379,h2,h3:26380/m/1?sentinel_password=sp"
    text = f"org/big={sentinel}, small=redis://r3:6379/0,other={sentinel}"
    assert parse_model_redis_urls(text) == {
        "org/big": sentinel,
        "small": "redis://r3:6379/0",
        "other": sentinel,
    }
    for bad in (f"a={sentinel},junk", "a=redis://r:1/0,junk", "a=redis+sentinel://h1,h2"):
        with pytest.raises(ValueError, match="CONVEYOR_MODEL_REDIS_URLS"):
            parse_model_redis_urls(bad)


def test_a_sentinel_url_is_shown_without_its_secrets() -> None:
    from shared.connections.url import shown_url

    url = "redis+sentinel://:pw@h1:26379,h2/m/1?sentinel_password=sp"
    assert shown_url(url) == "redis+sentinel://h1:26379,h2:26379/m/1"


def test_the_private_redis_start_never_logs_the_password(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    from conveyor import redis_server

    monkeypatch.setattr(redis_server.shutil, "which", lambda _: None)
    caplog.set_level(logging.INFO)
    with pytest.raises(RuntimeError) as caught:
        redis_server.start_private_redis("redis://:s3cret-pw@127.0.0.1:1/0", tmp_path)
    assert "127.0.0.1:1" in caplog.text and "127.0.0.1:1" in str(caught.value)
    assert "s3cret-pw" not in caplog.text and "s3cret-pw" not in str(caught.value)
