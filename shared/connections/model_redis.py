"""Which Redis a model lives on: the home Redis, or its own (``CONVEYOR_MODEL_REDIS_URLS``).

Conveyor shards **by model**: every key on a request's path (its job streams, run
journal, cancel flag, images and embeddings, the LoRA desired state of its base model)
belongs to one model, and a worker serves one model and talks to one Redis. A model
listed in ``CONVEYOR_MODEL_REDIS_URLS`` lives on its own Redis (a plain, unmodified
redis-server); every other model, and the control plane (key-cache invalidation, the
retention lock, the adapter locks), lives on the home Redis, ``CONVEYOR_REDIS_URL``.

Syntax: ``model=redis://host:port/db`` entries separated by commas (or whitespace). Two
models may share a URL; a URL equal to the home URL is the home Redis. A URL may be a
``redis+sentinel://h1:26379,h2:26379/<master>/<db>`` one (shared/connections/url.py): its own
commas list Sentinels, so an entry ends only where the next ``model=`` begins.
"""

from __future__ import annotations

import re
from collections.abc import Callable, Mapping

import redis.asyncio as aioredis

from shared.connections.url import is_sentinel_url, parse_sentinel_url

_URL = re.compile(r"^(redis|rediss|unix|redis\+sentinel)://\S+$")
_ENTRY_BREAK = re.compile(r"[,\s]+(?=[^,\s=]+=(?:redis|rediss|unix|redis\+sentinel)://)")
"""The commas (or whitespace) before the next ``model=<url>``: not those between a
Sentinel URL's hosts, nor the ``=`` of its query."""


def parse_model_redis_urls(text: str) -> dict[str, str]:
    """``model=url,...`` -> {model: url}; raises ValueError naming the bad entry."""
    found: dict[str, str] = {}
    for entry in (part.strip(", ") for part in _ENTRY_BREAK.split(text.strip())):
        if not entry:
            continue
        model, sep, url = entry.partition("=")
        model, url = model.strip(), url.strip()
        if not sep or not model or not _URL.match(url):
            raise ValueError(
                f"CONVEYOR_MODEL_REDIS_URLS: `{entry}` is not `model=redis://host:port/db`"
            )
        _check_url(model, url)
        if model in found and found[model] != url:
            raise ValueError(f"CONVEYOR_MODEL_REDIS_URLS: model `{model}` is listed twice")
        found[model] = url
    return found


def _check_url(model: str, url: str) -> None:
    """Commas only between a Sentinel URL's hosts: anywhere else a bad entry followed."""
    after_hosts = url.split("://", 1)[1].partition("/")[2]
    if "," in (after_hosts if is_sentinel_url(url) else url):
        raise ValueError(f"CONVEYOR_MODEL_REDIS_URLS: `{model}={url}` is not one URL")
    if not is_sentinel_url(url):
        return
    try:
        parse_sentinel_url(url)
    except ValueError as exc:
        raise ValueError(f"CONVEYOR_MODEL_REDIS_URLS: `{model}`: {exc}") from None


def check_served(urls: Mapping[str, str], served: set[str]) -> None:
    """Every model given its own Redis must be served here; raises ValueError."""
    unknown = sorted(set(urls) - served)
    if unknown:
        raise ValueError(
            f"CONVEYOR_MODEL_REDIS_URLS names {', '.join(unknown)}, not served here "
            f"(served: {', '.join(sorted(served))})"
        )


class ModelRedis:
    """One client per distinct Redis URL; :meth:`for_model` picks a model's."""

    def __init__(
        self,
        home_url: str,
        model_urls: Mapping[str, str],
        connect: Callable[[str], aioredis.Redis],
        *,
        home: aioredis.Redis | None = None,
    ) -> None:
        self.home_url = home_url
        self.home = home if home is not None else connect(home_url)
        self.by_url: dict[str, aioredis.Redis] = {home_url: self.home}
        for url in model_urls.values():
            if url not in self.by_url:
                self.by_url[url] = connect(url)
        self._model_urls = dict(model_urls)

    @property
    def sharded(self) -> bool:
        """More than one Redis."""
        return len(self.by_url) > 1

    def url_of(self, model: str) -> str:
        return self._model_urls.get(model, self.home_url)

    def for_model(self, model: str) -> aioredis.Redis:
        """The Redis of ``model`` (a base model: an adapter lives on its base's)."""
        return self.by_url[self.url_of(model)]

    async def aclose(self) -> None:
        for client in self.by_url.values():
            await client.aclose()
