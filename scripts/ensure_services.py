"""Make sure the services the tests talk to answer; start a Redis if none does."""

from __future__ import annotations

import sys
from pathlib import Path

from conveyor.redis_server import redis_answers, start_private_redis

TEST_REDIS_URL = "redis://127.0.0.1:6379/0"


def main() -> int:
    if redis_answers(TEST_REDIS_URL):
        print(f"redis: answering at {TEST_REDIS_URL}")
        return 0
    process = start_private_redis(TEST_REDIS_URL, Path(".conveyor/test"))
    print(f"redis: started a private redis-server (pid {process.pid}) at {TEST_REDIS_URL}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
