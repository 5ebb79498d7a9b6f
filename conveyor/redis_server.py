"""Use the Redis at CONVEYOR_REDIS_URL, or start a private, durable redis-server there.

Only a plain ``redis://`` URL gets a private server: a ``redis+sentinel://`` URL names
Sentinels and the master they watch, which an operator runs (docs/operations/several-hosts.md).
"""

from __future__ import annotations

import logging
import shutil
import signal
import subprocess
import time
from pathlib import Path
from urllib.parse import urlparse

from redis.exceptions import RedisError

from conveyor.supervisor import parent_death_signal
from shared.connections.url import is_sentinel_url, parse_sentinel_url, shown_url, sync_client

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
        client = sync_client(url, timeout_s=timeout_s, connect_timeout_s=timeout_s)
        try:
            return bool(client.ping())
        finally:
            client.close()
    except (RedisError, OSError):
        return False


def start_private_redis(url: str, data_dir: Path) -> subprocess.Popen[bytes]:
    """Start redis-server on the URL's host and port; raise if it cannot start."""
    if is_sentinel_url(url):
        raise RuntimeError(
            f"no Redis master answers through the Sentinels of {parse_sentinel_url(url)}; "
            "`conveyor up` starts a private Redis for a redis:// URL only: start the "
            "Sentinels and the master they watch first"
        )
    log.info("no Redis answers at %s; starting a private one", shown_url(url))
    binary = shutil.which("redis-server")
    if binary is None:
        raise RuntimeError(
            f"no Redis answers at {shown_url(url)} and no redis-server binary is installed; "
            "install one (apt-get install redis-server) or point CONVEYOR_REDIS_URL at a Redis"
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
    # Its own session, like the other children: Ctrl-C reaches `up` alone, and `up` stops
    # Redis last, once the workers have left the registry through it.
    process = subprocess.Popen(
        command,
        stdin=subprocess.DEVNULL,
        start_new_session=True,
        preexec_fn=parent_death_signal(signal.SIGTERM),  # SIGTERM: it syncs its AOF first
    )
    deadline = time.monotonic() + 10
    while time.monotonic() < deadline:
        if redis_answers(url, 0.2):
            log.info("started a private redis-server at %s (data in %s)", shown_url(url), folder)
            return process
        if process.poll() is not None:
            break
        time.sleep(0.1)
    process.kill()
    raise RuntimeError(
        f"redis-server did not start at {shown_url(url)}; see {folder / 'redis.log'}"
    )


def stop_private_redis(process: subprocess.Popen[bytes], timeout_s: float = 10) -> None:
    """SIGTERM, then SIGKILL if it is still up after ``timeout_s``: Redis refuses a
    shutdown while it writes an AOF it has just begun ("can't exit") and keeps running."""
    process.terminate()
    try:
        process.wait(timeout_s)
    except subprocess.TimeoutExpired:
        log.warning("the private redis-server did not stop in %.0fs; killing it", timeout_s)
        process.kill()
        process.wait()
