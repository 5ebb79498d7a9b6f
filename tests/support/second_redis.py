"""A private redis-server on a free port (the real thing, as CI has it) for tests that need
two Redis: started with the durable options `conveyor up` uses, killed and restarted at will."""

from __future__ import annotations

import signal
import subprocess
from dataclasses import dataclass
from pathlib import Path

from conveyor.redis_server import start_private_redis
from tests.e2e.stack import free_port


@dataclass
class PrivateRedis:
    url: str
    data_dir: Path
    process: subprocess.Popen[bytes] | None = None

    @classmethod
    def start_in(cls, data_dir: Path) -> PrivateRedis:
        server = cls(f"redis://127.0.0.1:{free_port()}/0", data_dir)
        server.start()
        return server

    def start(self) -> None:
        """Start (or restart: same port, same data folder, so the AOF is replayed)."""
        self.process = start_private_redis(self.url, self.data_dir)

    def kill(self) -> None:
        """SIGKILL, as a crashed host would."""
        if self.process is not None and self.process.poll() is None:
            self.process.send_signal(signal.SIGKILL)
            self.process.wait(10)
        self.process = None
