"""Use the Redis at CONVEYOR_REDIS_URL, or start a private, durable redis-server there."""

from __future__ import annotations

import logging
import shutil
import subprocess
import time
from pathlib import Path
from urllib.parse import urlparse

import redis
from redis.exceptions import RedisError

log = logging.getLogger(__name__)

DURABLE_OPTIONS = [
    "--appendonly",
    "yes",
    "--appendfsync",
    "everysec",
    "--maxmemory-policy",
    "noeviction",
]
"""Jobs survive a Redis restart only with AOF on and nothing evicted (DESIGN.md 3)."""


def redis_answers(url: str, timeout_s: float = 1.0) -> bool:
    try:
        client = redis.Redis.from_url(
            url, socket_connect_timeout=timeout_s, socket_timeout=timeout_s
        )
        try:
            return bool(client.ping())
        finally:
            client.close()
    except (RedisError, OSError):
        return False


def start_private_redis(url: str, data_dir: Path) -> subprocess.Popen[bytes]:
    """Start redis-server on the URL's host and port; raise if it cannot start."""
    binary = shutil.which("redis-server")
    if binary is None:
        raise RuntimeError(
            f"no Redis answers at {url} and no redis-server binary is installed; install one "
            "(apt-get install redis-server) or point CONVEYOR_REDIS_URL at a Redis"
        )
    parsed = urlparse(url)
    host, port = parsed.hostname or "127.0.0.1", parsed.port or 6379
    folder = (data_dir / "redis").resolve()
    folder.mkdir(parents=True, exist_ok=True)
    command = [
        binary,
        "--bind",
        host,
        "--port",
        str(port),
        "--dir",
        str(folder),
        "--save",
        "",
        "--logfile",
        str(folder / "redis.log"),
        *DURABLE_OPTIONS,
    ]
    process = subprocess.Popen(command, stdin=subprocess.DEVNULL)
    deadline = time.monotonic() + 10
    while time.monotonic() < deadline:
        if redis_answers(url, 0.2):
            log.info("started a private redis-server at %s (data in %s)", url, folder)
            return process
        if process.poll() is not None:
            break
        time.sleep(0.1)
    process.kill()
    raise RuntimeError(f"redis-server did not start at {url}; see {folder / 'redis.log'}")
