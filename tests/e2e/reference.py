"""vLLM's offline engine as the tests' reference: one ``offline_reference.py`` process per
session, so the tests that compare with it pay vLLM's start-up (tens of seconds on CPU)
once between them."""

from __future__ import annotations

import json
import os
import select
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

from tests.e2e.stack import Process

SCRIPT = Path(__file__).with_name("offline_reference.py")


class OfflineReference:
    """Starts the script (no waiting: the model loads while the caller goes on); ``ask``
    sends one task and waits for its answer; ``done`` from each user, ``close`` at the end."""

    def __init__(self, model: Path, log_path: Path, users: int) -> None:
        self.users = users
        self._buffer = b""
        with log_path.open("ab") as log:
            popen = subprocess.Popen(
                [sys.executable, str(SCRIPT), str(model)],
                stdin=subprocess.PIPE,
                stdout=subprocess.PIPE,
                stderr=log,
                start_new_session=True,
            )
        self.process = Process("offline-reference", popen, log_path)

    def ask(self, kind: str, timeout_s: float = 600, **task: Any) -> Any:
        stdin = self.process.popen.stdin
        assert stdin is not None and not stdin.closed, "the offline reference is closed"
        stdin.write(json.dumps({"kind": kind, **task}).encode() + b"\n")
        stdin.flush()
        try:
            return json.loads(self._read_line(time.monotonic() + timeout_s))
        except BaseException:
            self.close()  # a late answer must not be read as the next task's
            raise

    def _read_line(self, deadline: float) -> bytes:
        stdout = self.process.popen.stdout
        assert stdout is not None
        while b"\n" not in self._buffer:
            remaining = deadline - time.monotonic()
            assert remaining > 0, f"no answer in time:\n{self.process.log_tail()}"
            ready, _, _ = select.select([stdout], [], [], min(remaining, 1.0))
            chunk = os.read(stdout.fileno(), 1 << 20) if ready else b""
            alive = chunk or (not ready and self.process.popen.poll() is None)
            assert alive, f"the offline reference exited:\n{self.process.log_tail()}"
            self._buffer += chunk
        line, _, self._buffer = self._buffer.partition(b"\n")
        return line

    def done(self) -> None:
        """One user is done; after the last, the engine shuts down while the next tests
        run (its memory is back for them, not only at the session's end)."""
        self.users -= 1
        if self.users <= 0:
            self._end_tasks()

    def close(self) -> None:
        self._end_tasks()
        self.process.reap(time.monotonic() + 30)

    def _end_tasks(self) -> None:
        stdin = self.process.popen.stdin
        if stdin is not None and not stdin.closed:
            stdin.close()  # the script returns, vLLM shuts its engine down (seconds)
