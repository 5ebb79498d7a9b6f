"""`conveyor up` stops its private Redis even when Redis refuses SIGTERM (it does while it
writes an AOF it has just begun)."""

from __future__ import annotations

import subprocess
import sys

from conveyor.redis_server import stop_private_redis

IGNORES_SIGTERM = (
    "import signal, sys, time; signal.signal(signal.SIGTERM, signal.SIG_IGN); "
    "print('ready', flush=True); time.sleep(60)"
)


def test_a_process_that_ignores_sigterm_is_killed_after_the_timeout() -> None:
    process = subprocess.Popen([sys.executable, "-c", IGNORES_SIGTERM], stdout=subprocess.PIPE)
    assert process.stdout is not None and process.stdout.readline() == b"ready\n"
    stop_private_redis(process, timeout_s=0.2)
    assert process.returncode == -9


def test_a_process_that_stops_on_sigterm_is_not_killed() -> None:
    process = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
    stop_private_redis(process, timeout_s=10)
    assert process.returncode == -15
