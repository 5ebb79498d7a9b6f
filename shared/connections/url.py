"""Conveyor's Redis URLs: a plain Redis, or a master that Redis Sentinel watches.

Every Conveyor Redis URL (``CONVEYOR_REDIS_URL`` and the URLs derived from it) is one of

* ``redis://``, ``rediss://``, ``unix://``: redis-py's own URLs (``Redis.from_url``);
* ``redis+sentinel://[[user]:password@]host[:port][,host2[:port2],...]/service_name[/db]``
  ``[?sentinel_username=...&sentinel_password=...]``: the master Sentinel names
  ``service_name`` (``sentinel monitor <service_name> ...``), database ``db`` (0). Ports
  default to 26379. The user and password are the data nodes' (the master's and its
  replicas'); ``sentinel_username`` / ``sentinel_password`` are the Sentinels' own, when
  they ask for one. This is the grammar of the ``Redis-Sentinel-Url`` package, also read
  by Prefect/docket and RedisVL; redis-py has no URL for Sentinel.

A client opened on a Sentinel URL asks the Sentinels where the master is on every new
connection, so after a fail-over it reconnects to the promoted replica by itself
(redis-py's ``SentinelConnectionPool``; a connection still open to a demoted master gets
READONLY and is dropped). URL parsing lives here and only here; the clients of the other
modules are opened with :func:`sync_client` / :func:`async_client`, or
``shared.connections.connect.connect`` (the bounded pool of the long-lived processes).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Final
from urllib.parse import parse_qs, unquote, urlsplit

import redis
import redis.asyncio as aioredis
import redis.asyncio.retry
import redis.asyncio.sentinel as aiosentinel
import redis.retry
import redis.sentinel
from redis.backoff import NoBackoff

__all__ = [
    "DEFAULT_SENTINEL_PORT",
    "SCHEME",
    "AsyncSentinelMaster",
    "SentinelUrl",
    "async_client",
    "async_sentinel",
    "is_sentinel_url",
    "parse_sentinel_url",
    "sync_client",
]

SCHEME: Final = "redis+sentinel"
DEFAULT_SENTINEL_PORT: Final = 26379
_OPTIONS: Final = frozenset({"sentinel_username", "sentinel_password"})


@dataclass(frozen=True, slots=True)
class SentinelUrl:
    """A parsed ``redis+sentinel://`` URL."""

    sentinels: tuple[tuple[str, int], ...]
    service_name: str
    db: int = 0
    username: str | None = None
    password: str | None = None
    sentinel_username: str | None = None
    sentinel_password: str | None = None

    def node_kwargs(self) -> dict[str, Any]:
        """Connection arguments of the data nodes (master, replicas)."""
        return {"db": self.db, "username": self.username, "password": self.password}

    def sentinel_kwargs(self, *, timeout_s: float, connect_timeout_s: float) -> dict[str, Any]:
        """Connection arguments of the Sentinels themselves (no retries: redis-py asks the
        next Sentinel instead; its default, 10 with backoff, made a dead group 12 s)."""
        return {
            "socket_timeout": timeout_s,
            "socket_connect_timeout": connect_timeout_s,
            "username": self.sentinel_username,
            "password": self.sentinel_password,
        }

    def __str__(self) -> str:
        """The URL without its secrets (for logs)."""
        hosts = ",".join(f"{_host_text(host)}:{port}" for host, port in self.sentinels)
        return f"{SCHEME}://{hosts}/{self.service_name}/{self.db}"


def is_sentinel_url(url: str) -> bool:
    return url.split("://", 1)[0].lower() == SCHEME


def parse_sentinel_url(url: str) -> SentinelUrl:
    """Parse a ``redis+sentinel://`` URL; ``ValueError`` says what is wrong with it."""
    scheme, sep, rest = url.partition("://")
    if not sep or scheme.lower() != SCHEME:
        raise ValueError(f"not a {SCHEME}:// URL: {url!r}")
    rest, _, query = rest.partition("?")
    netloc, _, path = rest.partition("/")
    userinfo, at, hosts = netloc.rpartition("@")
    username, password = _userinfo(userinfo) if at else (None, None)
    options = _options(query)
    service_name, db = _path(path)
    return SentinelUrl(
        sentinels=tuple(_address(part) for part in hosts.split(",")),
        service_name=service_name,
        db=db,
        username=username,
        password=password,
        sentinel_username=options.get("sentinel_username"),
        sentinel_password=options.get("sentinel_password"),
    )


def _userinfo(userinfo: str) -> tuple[str | None, str | None]:
    user, colon, password = userinfo.partition(":")
    return (unquote(user) or None), (unquote(password) if colon else None)


def _options(query: str) -> dict[str, str]:
    parsed = parse_qs(query, keep_blank_values=True, strict_parsing=False)
    unknown = set(parsed) - _OPTIONS
    if unknown:
        raise ValueError(
            f"unknown {SCHEME}:// option(s) {sorted(unknown)}; known: {sorted(_OPTIONS)}"
        )
    return {name: values[-1] for name, values in parsed.items()}


def _path(path: str) -> tuple[str, int]:
    parts = [unquote(part) for part in path.split("/")] if path else []
    if parts and parts[-1] == "":
        parts.pop()  # a trailing slash
    if not parts or not parts[0]:
        raise ValueError(f"a {SCHEME}:// URL names the master: .../<service_name>[/<db>]")
    if len(parts) > 2:
        raise ValueError(f"a {SCHEME}:// path is /<service_name>[/<db>], not /{path}")
    if len(parts) == 1:
        return parts[0], 0
    try:
        db = int(parts[1])
    except ValueError:
        message = f"the database of a {SCHEME}:// URL is a number, not {parts[1]!r}"
        raise ValueError(message) from None
    if db < 0:
        raise ValueError(f"the database of a {SCHEME}:// URL is not negative ({db})")
    return parts[0], db


def _address(part: str) -> tuple[str, int]:
    if not part:
        raise ValueError(f"a {SCHEME}:// URL lists its Sentinels as host[:port],host[:port]")
    if part.startswith("["):  # [IPv6]:port
        host, bracket, port = part[1:].partition("]")
        if not bracket or (port and not port.startswith(":")):
            raise ValueError(f"bad Sentinel address {part!r}")
        return host, _port(port[1:], part)
    host, _, port = part.partition(":")
    if not host:
        raise ValueError(f"a Sentinel address has a host: {part!r}")
    return host, _port(port, part)


def _port(text: str, part: str) -> int:
    if not text:
        return DEFAULT_SENTINEL_PORT
    if not text.isdigit() or not 0 < int(text) < 65536:
        raise ValueError(f"bad port in Sentinel address {part!r}")
    return int(text)


def _host_text(host: str) -> str:
    return f"[{host}]" if ":" in host else host


# --------------------------------------------------------------------------- clients


class _SyncSentinelMaster(redis.Redis):
    """A master client that also closes its connections to the Sentinels."""

    def close(self) -> None:
        manager = getattr(self.connection_pool, "sentinel_manager", None)
        super().close()
        if manager is not None:
            manager.close()


class AsyncSentinelMaster(aioredis.Redis):
    """A master client that also closes its connections to the Sentinels."""

    async def aclose(self, close_connection_pool: bool | None = None) -> None:
        manager = getattr(self.connection_pool, "sentinel_manager", None)
        await super().aclose(close_connection_pool)
        if manager is not None:
            await manager.aclose()


def sync_client(url: str, *, timeout_s: float, connect_timeout_s: float) -> redis.Redis:
    """A blocking client for short-lived or threaded use (``Redis.from_url`` on a plain URL)."""
    if not is_sentinel_url(url):
        return redis.Redis.from_url(
            url, socket_timeout=timeout_s, socket_connect_timeout=connect_timeout_s
        )
    parsed = parse_sentinel_url(url)
    kwargs = parsed.sentinel_kwargs(timeout_s=timeout_s, connect_timeout_s=connect_timeout_s)
    kwargs["retry"] = redis.retry.Retry(NoBackoff(), 0)
    sentinel = redis.sentinel.Sentinel(  # type: ignore[no-untyped-call]
        list(parsed.sentinels), sentinel_kwargs=kwargs
    )
    client: redis.Redis = sentinel.master_for(  # type: ignore[no-untyped-call]
        parsed.service_name,
        redis_class=_SyncSentinelMaster,
        socket_timeout=timeout_s,
        socket_connect_timeout=connect_timeout_s,
        **parsed.node_kwargs(),
    )
    return client


def async_client(url: str, *, timeout_s: float, connect_timeout_s: float) -> aioredis.Redis:
    """An asyncio client with redis-py's default (unbounded) pool, for the CLI."""
    if not is_sentinel_url(url):
        return aioredis.Redis.from_url(
            url, socket_timeout=timeout_s, socket_connect_timeout=connect_timeout_s
        )
    parsed = parse_sentinel_url(url)
    client: aioredis.Redis = async_sentinel(
        parsed, timeout_s=timeout_s, connect_timeout_s=connect_timeout_s
    ).master_for(
        parsed.service_name,
        redis_class=AsyncSentinelMaster,
        socket_timeout=timeout_s,
        socket_connect_timeout=connect_timeout_s,
        **parsed.node_kwargs(),
    )
    return client


def async_sentinel(
    parsed: SentinelUrl, *, timeout_s: float, connect_timeout_s: float
) -> aiosentinel.Sentinel:
    """The asyncio Sentinel client of ``parsed``'s Sentinels."""
    kwargs = parsed.sentinel_kwargs(timeout_s=timeout_s, connect_timeout_s=connect_timeout_s)
    kwargs["retry"] = redis.asyncio.retry.Retry(NoBackoff(), 0)
    sentinels = list(parsed.sentinels)
    return aiosentinel.Sentinel(sentinels, sentinel_kwargs=kwargs)  # type: ignore[no-untyped-call]


def shown_url(url: str) -> str:
    """``url`` without credentials (safe to log and to show in /ready)."""
    if is_sentinel_url(url):
        return str(parse_sentinel_url(url))
    parts = urlsplit(url)
    host = parts.hostname or ""
    port = f":{parts.port}" if parts.port else ""
    return f"{parts.scheme}://{host}{port}{parts.path}"
